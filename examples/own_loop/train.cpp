// Your own training loop, from ddptrain's parts, the way one writes a loop
// with PyTorch DDP: the process group, the sampler, gradient sync, a plain
// torch::optim optimizer, checkpoints, Ctrl-C / SIGTERM, crash reports.
//   ./build/own_loop [DIR]                one CPU rank (or one per GPU); checkpoints in DIR
//   torchrun --nproc_per_node 2 --redirects 2 --tee 2 --no_python ./build/own_loop
#include <ddp/data/loader.h>
#include <ddp/data/sampler.h>
#include <ddp/data/synthetic.h>
#include <ddp/dist/grad_sync.h>
#include <ddp/dist/launch.h>
#include <ddp/dist/signals.h>
#include <ddp/dist/world.h>
#include <ddp/io/checkpoint.h>
#include <ddp/models/cnn.h>

namespace F = torch::nn::functional;

int main(int argc, char** argv) {
  // Started by hand: start the ranks (ddptrain's launcher; torchrun's
  // variables are honoured as well, and then this process is one rank).
  if (!ddp::placement_from_env().launched()) {
    ddp::LaunchOptions launch;
    launch.nproc_per_node = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 2;
    launch.argv.assign(argv, argv + argc);
    launch.argv[0] = ddp::self_executable();
    return ddp::launch_workers(launch);
  }
  ddp::install_crash_handler();  // a crash prints its native stack
  ddp::install_stop_handlers();  // SIGTERM / Ctrl-C: finish the step, then stop
  ddp::World world(ddp::placement_from_env());  // rank, world size, device, process group
  const auto device = world.device();
  if (!device.is_cuda()) torch::set_num_threads(1);

  torch::manual_seed(0);
  const auto data = ddp::data::make_synthetic(8000, 2000, /*seed=*/0);
  ddp::models::Cnn model(ddp::models::CnnOptions().in_channels(1).num_classes(10));
  model->to(device);
  ddp::GradSync sync(*model, world);  // broadcasts rank 0's weights; buckets all-reduce during backward
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(2e-3));

  const std::string dir = argc > 1 ? argv[1] : ".";
  const int epochs = 2, batch = 64;
  for (int epoch = 0; epoch < epochs; ++epoch) {
    model->train();
    ddp::DistributedSampler sampler({data.train->size(), world.size(), world.rank()});
    sampler.set_epoch(epoch);  // a new order every epoch
    ddp::data::Loader loader(data.train, sampler.indices(), ddp::data::LoaderOptions(batch).epoch(epoch));
    while (auto b = loader.next()) {
      // The gradients are views into GradSync's flat buffer: zero them there.
      // (optimizer.zero_grad() also works on LibTorch 2.x, where it sets them
      // to None and GradSync puts them back; 1.13's detaches them in place,
      // which LibTorch refuses for views.)
      sync.zero_grad();
      auto loss = F::cross_entropy(model->forward(b->input().to(device)), b->target().to(device));
      loss.backward();
      sync.finish();  // wait for the all-reduces; gradients are now the global mean
      optimizer.step();
      auto stop = torch::tensor({ddp::stop_requested() ? 1.0 : 0.0}, device);
      world.all_reduce(stop, "stop flag");  // every rank stops at the same step
      if (stop.item<double>() > 0) {
        if (world.is_main()) std::printf("stopped by a signal in epoch %d\n", epoch + 1);
        return 75;
      }
    }
    // Evaluation, sharded: every test sample is seen by exactly one rank.
    model->eval();
    torch::NoGradGuard no_grad;
    ddp::data::Loader test(data.test, ddp::shard_without_padding(data.test->size(), world.rank(), world.size()),
                           ddp::data::LoaderOptions(256));
    auto correct = torch::zeros({2}, torch::TensorOptions().dtype(torch::kDouble).device(device));
    while (auto b = test.next()) {
      auto predicted = model->forward(b->input().to(device)).argmax(1);
      correct[0] += predicted.eq(b->target().to(device)).sum().to(torch::kDouble);
      correct[1] += static_cast<double>(b->batch_size());
    }
    world.all_reduce(correct, "test accuracy");
    if (world.is_main()) {
      std::printf("epoch %d  test_acc %.4f\n", epoch + 1, (correct[0] / correct[1]).item<double>());
      ddp::TrainState state;
      state.epoch = epoch + 1;
      ddp::save_checkpoint(dir + "/own_loop_last.pt", *model, nullptr, {state, "own-loop-cnn", {}});  // atomic
    }
  }
  return 0;
}
