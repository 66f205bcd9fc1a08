// World: environment detection, TCPStore rendezvous and the process group.
#include "ddp/dist/world.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <sstream>

#include "ddp/dist/launch.h"
#include "ddp/error.h"

namespace ddp {
namespace {

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return (v && *v) ? v : nullptr;
}

int env_int(const char* name, int fallback) {
  const char* v = env(name);
  if (!v) return fallback;
  try {
    size_t used = 0;
    int x = std::stoi(v, &used);
    if (used == std::string(v).size()) return x;
  } catch (const std::exception&) {
  }
  throw UserError(std::string("environment variable ") + name + "='" + v + "' is not an integer.",
                  "unset it or give it a whole number.");
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1";
}

// The address of the local interface that routes to `host`: Gloo must listen
// on it so that ranks on other nodes can reach this one. A connected UDP
// socket sends nothing; it only asks the kernel for the route.
std::string local_address_towards(const std::string& host, int port) {
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(static_cast<uint16_t>(port > 0 ? port : 9));
  if (inet_pton(AF_INET, host.c_str(), &dst.sin_addr) != 1) return "";
  int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  if (fd < 0) return "";
  std::string out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof(dst)) == 0) {
    sockaddr_in me{};
    socklen_t len = sizeof(me);
    char buf[INET_ADDRSTRLEN];
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len) == 0 &&
        inet_ntop(AF_INET, &me.sin_addr, buf, sizeof(buf)))
      out = buf;
  }
  ::close(fd);
  return out;
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // "a[01-03,07],b" -> "a01"; "a,b" -> "a"; "a" -> "a"
  std::string out;
  for (size_t i = 0; i < nodelist.size(); ++i) {
    char c = nodelist[i];
    if (c == ',') break;
    if (c == '[') {
      size_t j = i + 1;
      while (j < nodelist.size() && std::isdigit(static_cast<unsigned char>(nodelist[j]))) ++j;
      out += nodelist.substr(i + 1, j - i - 1);
      break;
    }
    out += c;
  }
  return out;
}

Placement placement_from_env() {
  Placement p;
  if (env("RANK") && env("WORLD_SIZE")) {
    p.source = env("DDPTRAIN_LAUNCHER") ? "ddptrain" : "torchrun";
    p.rank = env_int("RANK", 0);
    p.world_size = env_int("WORLD_SIZE", 1);
    p.local_rank = env_int("LOCAL_RANK", p.rank);
    p.local_world_size = env_int("LOCAL_WORLD_SIZE", p.world_size);
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    p.source = "slurm";
    p.rank = env_int("SLURM_PROCID", 0);
    p.world_size = env_int("SLURM_NTASKS", 1);
    p.local_rank = env_int("SLURM_LOCALID", 0);
    // SLURM_NTASKS_PER_NODE may read "4" or "4(x2)"; the leading count is ours.
    const char* per_node = env("SLURM_NTASKS_PER_NODE");
    if (!per_node) per_node = env("SLURM_STEP_TASKS_PER_NODE");
    p.local_world_size = per_node ? std::atoi(per_node) : p.world_size;
    const char* nodes = env("SLURM_STEP_NODELIST");
    if (!nodes) nodes = env("SLURM_JOB_NODELIST");
    if (!nodes) nodes = env("SLURM_NODELIST");
    if (nodes) p.master_addr = first_slurm_host(nodes);
  } else if (env("OMPI_COMM_WORLD_RANK") && env("OMPI_COMM_WORLD_SIZE")) {
    p.source = "mpi";
    p.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    p.world_size = env_int("OMPI_COMM_WORLD_SIZE", 1);
    p.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    p.local_world_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", p.world_size);
  } else {
    return p;
  }
  if (env("MASTER_ADDR")) p.master_addr = env("MASTER_ADDR");
  p.master_port = env_int("MASTER_PORT", p.source == "torchrun" || p.source == "ddptrain" ? 0 : 29500);
  check_user(p.world_size >= 1 && p.rank >= 0 && p.rank < p.world_size,
             "rank " + std::to_string(p.rank) + " is outside world size " +
                 std::to_string(p.world_size) + " (from " + p.source + " variables).",
             "check RANK/WORLD_SIZE (or SLURM_PROCID/SLURM_NTASKS, OMPI_COMM_WORLD_*).");
  check_user(p.world_size == 1 || p.master_port > 0,
             "MASTER_PORT is not set for a job of " + std::to_string(p.world_size) + " ranks.",
             "export MASTER_PORT=<free port> (torchrun sets it for you).");
  return p;
}

World::World(const Placement& where, const WorldOptions& options)
    : where_(where), options_(options) {
  const std::string& b = options_.backend;
  check_user(b == "auto" || b == "nccl" || b == "gloo", "--backend '" + b + "' is not known.",
             "use auto, nccl or gloo.");
  bool want_cuda = options_.use_cuda && b != "gloo" && torch::cuda::is_available();
  check_user(!(b == "nccl" && !want_cuda), "--backend nccl needs a CUDA GPU, and none is visible.",
             "use --backend gloo (or auto) on CPU machines.");
#ifndef DDP_WITH_CUDA
  want_cuda = false;
#endif
  if (want_cuda) {
    int n = static_cast<int>(torch::cuda::device_count());
    check_user(where_.local_rank < n,
               "local rank " + std::to_string(where_.local_rank) + " has no GPU: only " +
                   std::to_string(n) + " visible.",
               "start at most " + std::to_string(n) + " ranks per node, or fix --visible / CUDA_VISIBLE_DEVICES.");
    device_ = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(where_.local_rank));
#ifdef DDP_WITH_CUDA
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(where_.local_rank));
#endif
  }
  backend_name_ = want_cuda ? "nccl" : "gloo";
  check_user(backend_name_ != "gloo" || compat::kHasGloo,
             "this ddptrain was built without the Gloo backend, which CPU ranks need.",
             "the CUDA LibTorch wheel ships no Gloo headers: use GPUs (--backend nccl), or build against Debian's libtorch-dev for CPU ranks.");

  // A launcher that hosts the store itself (ddptrain across nodes, torchrun's
  // static rendezvous) says so; then rank 0 is a client like the others, and
  // each restart uses its own keys in that long-lived store.
  const char* agent = env("TORCHELASTIC_USE_AGENT_STORE");
  const bool agent_store = agent && (std::string(agent) == "True" || std::string(agent) == "1");
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(where_.master_port);
  so.isServer = where_.rank == 0 && !agent_store;
  so.numWorkers = static_cast<size_t>(where_.world_size);
  so.waitWorkers = false;
  so.timeout = options_.timeout;
  const std::string addr = where_.master_addr;
  // A busy port, in one line before c10d logs its own attempts to stderr.
  check_user(!so.isServer || so.port == 0 || !port_in_use(so.port),
             "rank 0 cannot host the rendezvous store: port " + std::to_string(so.port) +
                 " is already in use on this machine (another job or program listens there).",
             "pass another --port (or MASTER_PORT), or omit --port to let ddptrain pick a free one.");
  try {
    store_ = c10::make_intrusive<c10d::TCPStore>(addr, so);
    // Every key lives under the job's secret token when ddptrain's launcher
    // gave one, so that a client without it cannot write what the ranks read.
    std::string prefix = "ddp";
    if (const char* token = env("DDPTRAIN_JOB_TOKEN")) prefix += std::string("/job/") + token;
    if (agent_store) {
      const char* attempt = env("TORCHELASTIC_RESTART_COUNT");
      prefix += std::string("/attempt") + (attempt ? attempt : "0");
    }
    if (prefix != "ddp") store_ = c10::make_intrusive<c10d::PrefixStore>(prefix, store_);
  } catch (const std::exception& e) {
    if (so.isServer)
      throw UserError("rank 0 could not open the rendezvous store on " + addr + ":" +
                          std::to_string(where_.master_port) + " (" + first_line(e) + ").",
                      "the port may be in use: pass a free --port (or MASTER_PORT), or omit --port on one node.");
    throw UserError("rank " + std::to_string(where_.rank) + " could not reach the rendezvous store at " +
                        addr + ":" + std::to_string(where_.master_port) + " within " +
                        std::to_string(options_.timeout.count() / 1000) + " s (" + first_line(e) + ").",
                    "check --address/--port (MASTER_ADDR/MASTER_PORT), that rank 0 started, and the firewall.");
  }
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("ddp/pg", store_);

#ifdef DDP_WITH_CUDA
  if (backend_name_ == "nccl") {
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = options_.timeout;
    pg_ = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, where_.rank, where_.world_size, opts);
  }
#endif
#ifdef DDP_WITH_GLOO
  if (backend_name_ == "gloo") {
    auto opts = c10d::ProcessGroupGloo::Options::create(options_.timeout);
    if (const char* ifname = env("GLOO_SOCKET_IFNAME")) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    } else if (is_loopback(addr)) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    } else {
      std::string me = local_address_towards(addr, where_.master_port);
      opts->devices.push_back(me.empty() ? c10d::ProcessGroupGloo::createDefaultDevice()
                                         : c10d::ProcessGroupGloo::createDeviceForHostname(me));
    }
    try {
      pg_ = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, where_.rank, where_.world_size, opts);
    } catch (const std::exception& e) {
      throw UserError("rank " + std::to_string(where_.rank) + " could not join the Gloo group (" +
                          first_line(e) + ").",
                      "all ranks must start within --timeout; set GLOO_SOCKET_IFNAME to the interface that connects the nodes.");
    }
  }
#endif
}

World::~World() { shutdown(); }

void World::shutdown() {
  if (pg_) compat::shutdown_backend(pg_);
  pg_.reset();
  store_.reset();
}

void World::fail(const std::string& what, const std::exception& e) const {
  std::ostringstream os;
  os << "rank " << where_.rank << " of " << where_.world_size << ": collective '" << what
     << "' failed on " << backend_name_ << " (timeout " << options_.timeout.count() / 1000.0
     << " s): " << first_line(e)
     << ". Hint: another rank probably died or stalled; its own error is printed above."
     << " Raise --timeout only if a rank is legitimately slow.";
  throw CollectiveError(os.str());
}

c10::intrusive_ptr<compat::Work> World::all_reduce_async(torch::Tensor& t) {
  std::vector<torch::Tensor> v{t};
  return pg_->allreduce(v);
}

std::vector<c10::intrusive_ptr<compat::Work>> World::reduce_scatter_async(std::vector<torch::Tensor>& parts) {
  return compat::reduce_scatter_parts(pg_, parts, rank());
}

void World::wait(const c10::intrusive_ptr<compat::Work>& work, const std::string& what) {
  try {
    settle(work);
  } catch (const std::exception& e) {
    fail(what, e);
  }
}

void World::settle(const c10::intrusive_ptr<compat::Work>& work) const {
  // On CUDA the wait must only order the current stream after NCCL's: a
  // wait with a timeout makes ProcessGroupNCCL poll on the host until the
  // collective is done (WorkNCCL::wait in 2.x), so the host could no longer
  // queue work ahead, and a CUDA graph capture forbids it. A hang is still
  // bounded: NCCL's watchdog enforces the group's timeout (--timeout).
  // Gloo runs on the host anyway, and there the timed wait names the call.
  if (device_.is_cuda() || compat::stream_capturing())
    work->wait();
  else
    work->wait(options_.timeout);
}

void World::all_reduce(torch::Tensor& t, const std::string& what, c10d::ReduceOp op) {
  try {
    std::vector<torch::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = op;
    settle(pg_->allreduce(v, o));
  } catch (const std::exception& e) {
    fail(what, e);
  }
}

void World::broadcast(torch::Tensor& t, int root, const std::string& what) {
  try {
    settle(broadcast_async(t, root));
  } catch (const std::exception& e) {
    fail(what, e);
  }
}

c10::intrusive_ptr<compat::Work> World::broadcast_async(torch::Tensor& t, int root) {
  std::vector<torch::Tensor> v{t};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  return pg_->broadcast(v, o);
}

void World::barrier(const std::string& what) {
  auto t = torch::zeros({1}, torch::TensorOptions().device(device_));
  all_reduce(t, "barrier: " + what);
  (void)t.item<float>();  // on CUDA the wait above is stream-ordered; a barrier holds the host too
}

std::string World::share_string(const std::string& key, const std::string& value_on_root, int root) {
  const std::string k = "ddp/share/" + key + "/" + std::to_string(share_counter_++);
  try {
    if (where_.rank == root) {
      store_->set(k, std::vector<uint8_t>(value_on_root.begin(), value_on_root.end()));
      return value_on_root;
    }
    auto bytes = store_->get(k);
    return std::string(bytes.begin(), bytes.end());
  } catch (const std::exception& e) {
    fail("share " + key, e);
  }
}

}  // namespace ddp
