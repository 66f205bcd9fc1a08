// Two inputs, a custom loss with its own flag, and macro-F1 as the monitor
// (see task.h):
//   ./build/two_inputs                       one CPU rank or every GPU
//   ./build/two_inputs --aux-weight 0.5 --stop-at test_f1=0.9
#include "task.h"

int main(int argc, char** argv) { return ddp::main(argc, argv, std::make_shared<two_inputs::WeightedTask>()); }
