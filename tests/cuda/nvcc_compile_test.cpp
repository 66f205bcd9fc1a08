// ddptrain's CUDA kernels (src/cuda/*.cu) compiled with nvcc on a CPU build.
//
// A CPU build of LibTorch does not compile them, and a GPU machine is a
// scarce thing: without this test, a kernel that no longer compiles (or a
// LibTorch 2.x-only call that belongs in the compat header) is found only
// on the next device call. Debian's libtorch-dev ships the CUDA headers of
// ATen and c10 but not the one header a CUDA build generates
// (c10/cuda/impl/cuda_cmake_macros.h), which this test stands in for with
// an empty one. Each file is compiled for sm_90 (the H200) to a cubin
// that is thrown away; ptxas's register spills are printed, not failed.
// A cubin leaves out nvcc's host passes (cudafe++ and g++ over the torch
// headers again: 2.3x the time): the device pass's front end parses the
// whole file, host functions and their templates included, and the GPU
// build runs g++ on it.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "support/testing.h"

namespace {

#ifndef DDP_WITH_CUDA
namespace fs = std::filesystem;
using ddp::testing::Child;
using ddp::testing::ProcessResult;

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, sep);)
    if (!item.empty()) out.push_back(item);
  return out;
}

// The lines of `text` that contain `needle`.
std::vector<std::string> lines_with(const std::string& text, const std::string& needle) {
  std::vector<std::string> out;
  for (const auto& line : split(text, '\n'))
    if (line.find(needle) != std::string::npos) out.push_back(line);
  return out;
}
#endif

TEST(CudaSources, CompileForSm90WithNvccInACpuBuild) {
#ifdef DDP_WITH_CUDA
  GTEST_SKIP() << "a CUDA build compiles src/cuda/*.cu itself";
#else
  const std::string nvcc = DDP_NVCC;
  if (nvcc.empty()) GTEST_SKIP() << "no nvcc was found when the build was configured";

  std::vector<std::string> sources;
  for (const auto& entry : fs::directory_iterator(fs::path(DDP_SOURCE_DIR) / "src" / "cuda"))
    if (entry.path().extension() == ".cu") sources.push_back(entry.path().string());
  std::sort(sources.begin(), sources.end());
  ASSERT_FALSE(sources.empty()) << "src/cuda/*.cu: expected ddptrain's kernels there";
  // A kernel file the CUDA build does not list would compile here and be
  // missing there.
  const std::string cmake = ddp::testing::read_file(std::string(DDP_SOURCE_DIR) + "/CMakeLists.txt");
  for (const auto& src : sources)
    EXPECT_NE(cmake.find("src/cuda/" + fs::path(src).filename().string()), std::string::npos)
        << src << " is not among CMakeLists.txt's CUDA sources";

  const std::string stand_in = ddp::testing::temp_dir("nvcc_compile");
  fs::create_directories(fs::path(stand_in) / "c10" / "cuda" / "impl");
  std::ofstream(fs::path(stand_in) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h")
      << "#pragma once\n// stands in for the header a CUDA build of LibTorch generates\n";

  std::vector<std::string> common = {nvcc, "-std=c++17", "-O3", "-arch=sm_90", "-Xptxas", "-v",
                                     "-DDDP_WITH_CUDA=1", "-DDDP_WITH_CUDA_KERNELS=1",
                                     "-I" + std::string(DDP_SOURCE_DIR) + "/include", "-I" + stand_in};
  for (const auto& dir : split(DDP_TORCH_INCLUDE_DIRS, '|')) common.push_back("-I" + dir);

  // Two at a time: the CI machine has two cores.
  std::vector<std::pair<std::string, Child>> running;
  auto finish = [&](std::pair<std::string, Child>& job) {
    ProcessResult r = ddp::testing::finish_process(job.second, 600);
    const std::string name = fs::path(job.first).filename().string();
    std::string errors;
    for (const auto& line : lines_with(r.output, "error")) errors += "  " + line + "\n";
    EXPECT_EQ(r.exit_code, 0) << "nvcc failed on src/cuda/" << name << ":\n" << errors;
    const auto spill_lines = lines_with(r.output, "bytes spill stores");
    const auto spilling = std::count_if(spill_lines.begin(), spill_lines.end(), [](const std::string& line) {
      return line.find(" 0 bytes spill stores") == std::string::npos;
    });
    std::cout << "[ nvcc     ] src/cuda/" << name << ": " << spilling << " kernel(s) spilling registers\n";
  };
  for (const auto& src : sources) {
    if (running.size() == 2) {
      finish(running.front());
      running.erase(running.begin());
    }
    auto argv = common;
    argv.insert(argv.end(), {"-cubin", src, "-o", stand_in + "/" + fs::path(src).stem().string() + ".cubin"});
    running.emplace_back(src, ddp::testing::start_process(argv));
  }
  for (auto& job : running) finish(job);
#endif
}

}  // namespace
