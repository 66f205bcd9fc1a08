// ddptrain: the command-line trainer. Everything lives in the library; see
// include/ddp/app.h for what main() does.
#include "ddp/app.h"

int main(int argc, char** argv) { return ddp::main(argc, argv); }
