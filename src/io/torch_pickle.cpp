// A minimal pickle reader and writer for torch.save state_dict files.
//
// Files are read by hand (ZipArchive below), not with caffe2::serialize's
// PyTorchStreamReader, which allocates a record's declared size before it
// checks it. They are written with caffe2's PyTorchStreamWriter, which needs
// no shim in compat.h: the calls used (Writer(std::function<size_t(const
// void*, size_t)>), writeRecord, writeEndOfFile) read the same in LibTorch
// 1.13 and 2.x, which only adds defaulted arguments (crc32, alignment).
#include "ddp/io/torch_pickle.h"

#include <caffe2/serialize/inline_container.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string_view>
#include <functional>
#include <map>
#include <memory>
#include <unordered_map>

#include "ddp/io/checkpoint.h"
#include "ddp/error.h"

namespace ddp {
namespace {

// Storage bytes are copied as they are: the files are little endian.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "torch_pickle assumes a little-endian machine");

const char* const kHint = "save the weights in Python with torch.save(model.state_dict(), path).";

// torch.<Name>Storage globals and the dtypes they stand for.
const std::vector<std::pair<std::string, c10::ScalarType>>& storage_types() {
  static const std::vector<std::pair<std::string, c10::ScalarType>> types{
      {"FloatStorage", c10::kFloat},   {"DoubleStorage", c10::kDouble},
      {"HalfStorage", c10::kHalf},     {"BFloat16Storage", c10::kBFloat16},
      {"LongStorage", c10::kLong},     {"IntStorage", c10::kInt},
      {"ShortStorage", c10::kShort},   {"CharStorage", c10::kChar},
      {"ByteStorage", c10::kByte},     {"BoolStorage", c10::kBool},
      {"ComplexFloatStorage", c10::kComplexFloat}, {"ComplexDoubleStorage", c10::kComplexDouble}};
  return types;
}

// ---------------------------------------------------------------- reading

// A value on the unpickler's stack. Lists and dicts are shared: the memo and
// the stack can hold the same one, and APPEND/SETITEM change it in place.
struct Value {
  enum Kind { kNone, kBool, kInt, kFloat, kString, kTuple, kList, kDict, kGlobal, kStorage, kTensor };
  Kind kind = kNone;
  int64_t i = 0;         // bool, int
  double f = 0;          // float
  // A string; "module.name" of a global; a storage's key. Shared, like
  // items: BINGET of a memoised string costs a pointer, not a copy.
  std::shared_ptr<const std::string> str;
  std::shared_ptr<std::vector<Value>> items;  // tuple, list; a dict as key, value, key, value...
  torch::Tensor tensor;  // a tensor, or a storage as a 1-D tensor of its dtype

  const std::string& s() const {
    static const std::string empty;
    return str ? *str : empty;
  }
  static Value text(Kind k, std::string s) {
    Value v;
    v.kind = k;
    v.str = std::make_shared<const std::string>(std::move(s));
    return v;
  }
  static Value of(Kind k) {
    Value v;
    v.kind = k;
    if (k == kTuple || k == kList || k == kDict) v.items = std::make_shared<std::vector<Value>>();
    return v;
  }
  const char* kind_name() const {
    static const char* const names[] = {"None", "bool", "int",    "float",   "str",   "tuple",
                                        "list", "dict", "global", "storage", "tensor"};
    return names[kind];
  }
};

// Reads the storage record `key` as `numel` elements of `dtype`.
using StorageLoader = std::function<torch::Tensor(const std::string& key, c10::ScalarType dtype, int64_t numel)>;

class Unpickler {
 public:
  Unpickler(std::string file, const uint8_t* data, size_t size, StorageLoader load)
      : file_(std::move(file)), data_(data), size_(size), load_(std::move(load)) {}

  Value run() {
    for (;;) {
      const size_t at = pos_;
      const uint8_t op = take_byte();
      switch (op) {
        case 0x80: take_byte(); break;  // PROTO n
        case 0x95: take(8); break;      // FRAME: a length hint only
        case '.': return pop();         // STOP
        case '(': marks_.push_back(stack_.size()); break;  // MARK
        case 'c': {                                         // GLOBAL module\n name\n
          std::string module = line(), name = line();
          push(global(module, name));
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          Value name = pop(), module = pop();
          if (module.kind != Value::kString || name.kind != Value::kString) fail("STACK_GLOBAL without strings", at);
          push(global(module.s(), name.s()));
          break;
        }
        case 'q': memo_[take_byte()] = top(); break;                // BINPUT
        case 'r': memo_[uint32_t(little(4))] = top(); break;        // LONG_BINPUT
        case 0x94: memo_[memo_.size()] = top(); break;              // MEMOIZE
        case 'h': push(memo(take_byte(), at)); break;               // BINGET
        case 'j': push(memo(uint32_t(little(4)), at)); break;       // LONG_BINGET
        case '}': push(Value::of(Value::kDict)); break;             // EMPTY_DICT
        case ']': push(Value::of(Value::kList)); break;             // EMPTY_LIST
        case ')': push(Value::of(Value::kTuple)); break;            // EMPTY_TUPLE
        case 0x85: case 0x86: case 0x87: push(tuple_of_top(op - 0x84)); break;  // TUPLE1..3
        case 't': {  // TUPLE
          Value t = Value::of(Value::kTuple);
          *t.items = pop_mark(at);
          push(t);
          break;
        }
        case 'l': {  // LIST
          Value l = Value::of(Value::kList);
          *l.items = pop_mark(at);
          push(l);
          break;
        }
        case 'd': {  // DICT
          Value d = Value::of(Value::kDict);
          *d.items = pop_mark(at);
          if (d.items->size() % 2) fail("DICT with an odd number of items", at);
          push(d);
          break;
        }
        case 'a': {  // APPEND
          Value v = pop();
          target(Value::kList, "APPEND", at).items->push_back(v);
          break;
        }
        case 'e': {  // APPENDS
          auto vs = pop_mark(at);
          auto& list = *target(Value::kList, "APPENDS", at).items;
          list.insert(list.end(), vs.begin(), vs.end());
          break;
        }
        case 's': {  // SETITEM
          Value v = pop(), k = pop();
          auto& dict = *target(Value::kDict, "SETITEM", at).items;
          dict.push_back(k);
          dict.push_back(v);
          break;
        }
        case 'u': {  // SETITEMS
          auto kvs = pop_mark(at);
          if (kvs.size() % 2) fail("SETITEMS with an odd number of items", at);
          auto& dict = *target(Value::kDict, "SETITEMS", at).items;
          dict.insert(dict.end(), kvs.begin(), kvs.end());
          break;
        }
        case 'K': push(integer(take_byte())); break;                                // BININT1
        case 'M': push(integer(int64_t(little(2)))); break;                         // BININT2
        case 'J': push(integer(int64_t(int32_t(uint32_t(little(4)))))); break;      // BININT
        case 0x8a: push(integer(long1(at))); break;                                 // LONG1
        case 'G': {  // BINFLOAT: 8 bytes, big endian
          uint64_t bits = 0;
          for (uint8_t b : bytes(8)) bits = bits << 8 | b;
          Value v = Value::of(Value::kFloat);
          std::memcpy(&v.f, &bits, sizeof v.f);
          push(v);
          break;
        }
        case 'X': push(string(little(4))); break;      // BINUNICODE
        case 0x8c: push(string(take_byte())); break;   // SHORT_BINUNICODE
        case 0x8d: push(string(little(8))); break;     // BINUNICODE8
        case 'N': push(Value()); break;                // NONE
        case 0x88: case 0x89: {                        // NEWTRUE, NEWFALSE
          Value v = Value::of(Value::kBool);
          v.i = op == 0x88;
          push(v);
          break;
        }
        case 'R': {  // REDUCE: callable(*args)
          Value args = pop(), fn = pop();
          if (fn.kind != Value::kGlobal || args.kind != Value::kTuple) fail("REDUCE of a " + std::string(fn.kind_name()), at);
          push(call(fn.s(), *args.items, at));
          break;
        }
        case 'Q': {  // BINPERSID
          Value pid = pop();
          push(persistent_load(pid, at));
          break;
        }
        case 'b': {  // BUILD: sets an object's state
          pop();
          // The one BUILD in a state_dict sets OrderedDict._metadata (each
          // module's version), which loading does not need.
          if (top().kind != Value::kDict) fail("BUILD on a " + std::string(top().kind_name()), at);
          break;
        }
        default: {
          char name[32];
          std::snprintf(name, sizeof name, "pickle opcode 0x%02x", op);
          std::string what = name;
          if (op >= 32 && op < 127) what += std::string(" ('") + char(op) + "')";
          fail(what + " is not supported", at);
        }
      }
    }
  }

 private:
  [[noreturn]] void fail(const std::string& what, size_t at) const {
    throw UserError("cannot read " + file_ + ": " + what + " (data.pkl byte " + std::to_string(at) +
                        "); ddptrain reads state_dicts of tensors only.",
                    kHint);
  }

  const uint8_t* take(size_t n) {
    if (n > size_ - pos_) fail("the pickle ends early", pos_);
    const uint8_t* p = data_ + pos_;
    pos_ += n;
    return p;
  }
  std::vector<uint8_t> bytes(size_t n) {
    const uint8_t* p = take(n);
    return {p, p + n};
  }
  uint8_t take_byte() { return *take(1); }
  uint64_t little(size_t n) {  // an n-byte little-endian unsigned integer
    const uint8_t* p = take(n);
    uint64_t v = 0;
    for (size_t k = n; k-- > 0;) v = v << 8 | p[k];
    return v;
  }
  int64_t long1(size_t at) {  // LONG1: n bytes of little-endian two's complement
    const size_t n = take_byte();
    if (n > 8) fail("an integer of " + std::to_string(n) + " bytes", at);
    if (n == 0) return 0;
    uint64_t v = little(n);
    if (n < 8 && (v >> (8 * n - 1) & 1)) v |= ~uint64_t(0) << (8 * n);  // sign-extend
    return static_cast<int64_t>(v);
  }
  std::string line() {
    const size_t start = pos_;
    while (take_byte() != '\n') {
    }
    return std::string(reinterpret_cast<const char*>(data_ + start), pos_ - start - 1);
  }
  Value string(uint64_t n) {
    const uint8_t* p = take(n);
    return Value::text(Value::kString, std::string(reinterpret_cast<const char*>(p), n));
  }
  static Value integer(int64_t i) {
    Value v = Value::of(Value::kInt);
    v.i = i;
    return v;
  }

  void push(Value v) { stack_.push_back(std::move(v)); }
  Value& top() {
    if (stack_.empty()) fail("the pickle is corrupt (empty stack)", pos_);
    return stack_.back();
  }
  Value pop() {
    Value v = top();
    stack_.pop_back();
    return v;
  }
  std::vector<Value> pop_mark(size_t at) {
    if (marks_.empty() || marks_.back() > stack_.size()) fail("the pickle is corrupt (no MARK)", at);
    std::vector<Value> items(stack_.begin() + static_cast<std::ptrdiff_t>(marks_.back()), stack_.end());
    stack_.resize(marks_.back());
    marks_.pop_back();
    return items;
  }
  Value tuple_of_top(size_t n) {
    if (stack_.size() < n) fail("the pickle is corrupt (empty stack)", pos_ - 1);
    Value t = Value::of(Value::kTuple);
    t.items->assign(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
    stack_.resize(stack_.size() - n);
    return t;
  }
  Value& target(Value::Kind kind, const char* opcode, size_t at) {
    Value& t = top();
    if (t.kind != kind) fail(std::string(opcode) + " on a " + t.kind_name(), at);
    return t;
  }
  Value memo(uint64_t key, size_t at) {
    auto it = memo_.find(key);
    if (it == memo_.end()) fail("the pickle is corrupt (memo " + std::to_string(key) + " unset)", at);
    return it->second;
  }

  // The globals a state_dict uses; anything else (a model class, a numpy
  // array, torch.device...) is named and refused.
  Value global(const std::string& module, const std::string& name) {
    const std::string full = module + "." + name;
    static const char* const callables[] = {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2",
                                            "torch._utils._rebuild_parameter",
                                            "torch._utils._rebuild_parameter_with_state"};
    bool known = std::find(std::begin(callables), std::end(callables), full) != std::end(callables);
    for (const auto& [storage, dtype] : storage_types()) known = known || (module == "torch" && name == storage);
    if (!known) fail("the global '" + full + "' is not part of a state_dict of tensors", pos_);
    return Value::text(Value::kGlobal, full);
  }

  Value call(const std::string& fn, const std::vector<Value>& args, size_t at) {
    if (fn == "collections.OrderedDict") {
      if (!args.empty()) fail("OrderedDict called with arguments", at);
      return Value::of(Value::kDict);
    }
    if (fn == "torch._utils._rebuild_tensor_v2") return rebuild_tensor(args, at);
    // A Parameter saved as such (a dict of named_parameters()): its tensor.
    if (args.empty() || args[0].kind != Value::kTensor) fail(fn + " without a tensor", at);
    return args[0];
  }

  static bool is_int(const Value& v) { return v.kind == Value::kInt; }
  std::vector<int64_t> ints(const Value& v, const char* what, size_t at) {
    if (v.kind != Value::kTuple) fail(std::string("a tensor's ") + what + " is a " + v.kind_name(), at);
    std::vector<int64_t> out;
    for (const auto& x : *v.items) {
      if (!is_int(x) || x.i < 0) fail(std::string("a tensor's ") + what + " is not a tuple of sizes", at);
      out.push_back(x.i);
    }
    return out;
  }

  // _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
  // backward_hooks[, metadata]): a view into the storage.
  Value rebuild_tensor(const std::vector<Value>& args, size_t at) {
    if (args.size() < 6 || args.size() > 7 || args[0].kind != Value::kStorage || !is_int(args[1]))
      fail("_rebuild_tensor_v2 with unexpected arguments", at);
    const torch::Tensor& storage = args[0].tensor;
    const int64_t offset = args[1].i;
    const auto size = ints(args[2], "size", at), stride = ints(args[3], "stride", at);
    if (size.size() != stride.size()) fail("a tensor's size and stride differ in length", at);
    // The last element the view touches, and its element count, in
    // arithmetic that cannot overflow (sizes and strides are >= 0 here).
    // A view with more elements than its storage (a broadcast, stride 0)
    // is refused too: copying it could take any amount of memory.
    int64_t last = offset, numel = 1;
    bool empty = false, overflow = false;
    for (size_t d = 0; d < size.size(); ++d) {
      int64_t reach = 0;
      empty = empty || size[d] == 0;
      overflow = overflow || __builtin_mul_overflow(size[d] == 0 ? 0 : size[d] - 1, stride[d], &reach) ||
                 __builtin_add_overflow(last, reach, &last) || __builtin_mul_overflow(numel, size[d], &numel);
    }
    if (offset < 0 || offset > storage.numel() || (!empty && (overflow || last >= storage.numel())))
      fail("a tensor reaches past the end of storage '" + args[0].s() + "'", at);
    if (numel > storage.numel())
      fail("a tensor has more elements (" + std::to_string(numel) + ") than its storage '" + args[0].s() + "' (" +
               std::to_string(storage.numel()) + "); save it with .contiguous()",
           at);
    Value v = Value::of(Value::kTensor);
    v.tensor = torch::empty({0}, storage.options()).set_(storage.storage(), offset, size, stride);
    return v;
  }

  // ('storage', torch.<Type>Storage, key, location, numel): loaded once per
  // key, so that views of one storage share it as they did in Python.
  Value persistent_load(const Value& pid, size_t at) {
    const auto* t = pid.kind == Value::kTuple ? pid.items.get() : nullptr;
    if (!t || t->size() != 5 || (*t)[0].kind != Value::kString || (*t)[0].s() != "storage" ||
        (*t)[1].kind != Value::kGlobal || (*t)[2].kind != Value::kString || !is_int((*t)[4]))
      fail("a persistent id that is not a tensor storage", at);
    const std::string& key = (*t)[2].s();
    auto it = storages_.find(key);
    if (it == storages_.end()) {
      c10::ScalarType dtype = c10::kFloat;
      bool found = false;
      for (const auto& [name, type] : storage_types()) {
        if ((*t)[1].s() == "torch." + name) {
          dtype = type;
          found = true;
        }
      }
      if (!found) fail("the storage type '" + (*t)[1].s() + "' is not supported", at);
      it = storages_.emplace(key, load_(key, dtype, (*t)[4].i)).first;
    }
    Value v = Value::text(Value::kStorage, key);
    v.tensor = it->second;
    return v;
  }

  const std::string file_;
  const uint8_t* data_;
  const size_t size_;
  size_t pos_ = 0;
  StorageLoader load_;
  std::vector<Value> stack_;
  std::vector<size_t> marks_;  // stack heights at each MARK
  std::unordered_map<uint64_t, Value> memo_;
  std::map<std::string, torch::Tensor> storages_;
};

// ---------------------------------------------------------------- writing

// Emits pickle protocol 2, the subset that torch.save writes for a state_dict
// and that the weights_only unpickler accepts.
class Pickler {
 public:
  std::string bytes;

  void op(uint8_t code) { bytes.push_back(static_cast<char>(code)); }
  void global(const std::string& module, const std::string& name) {
    op('c');
    bytes += module + "\n" + name + "\n";
  }
  void string(const std::string& s) {  // BINUNICODE
    op('X');
    little(s.size(), 4);
    bytes += s;
  }
  void integer(int64_t v) {
    if (v >= 0 && v < 256) {
      op('K');
      little(uint64_t(v), 1);
    } else if (v >= 0 && v < 65536) {
      op('M');
      little(uint64_t(v), 2);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      op('J');
      little(uint64_t(uint32_t(int32_t(v))), 4);
    } else {  // LONG1: 8 bytes of two's complement are always enough
      op(0x8a);
      little(8, 1);
      little(uint64_t(v), 8);
    }
  }
  void ints(c10::IntArrayRef values) {  // a tuple of ints
    op('(');
    for (int64_t v : values) integer(v);
    op('t');
  }
  void new_ordered_dict() {  // collections.OrderedDict()
    global("collections", "OrderedDict");
    op(')');
    op('R');
  }

 private:
  void little(uint64_t v, size_t n) {
    for (size_t k = 0; k < n; ++k) bytes.push_back(static_cast<char>(v >> (8 * k) & 0xff));
  }
};

// ---------------------------------------------------------------- the zip

// The zip archive that torch.save writes, read by hand so that no length in
// the file is believed before it is checked against the file itself: the
// whole file is read once (as many bytes as it really has), and every
// record is a range inside it. torch.save stores records uncompressed, in
// one top-level folder (archive/data.pkl, archive/data/0, ...); zip64
// fields, which large files need, are understood.
class ZipArchive {
 public:
  // Mapped, not read: a reader that needs one record (a checkpoint's header)
  // pages in kilobytes of a checkpoint of gigabytes. ddptrain replaces
  // files by rename, so a mapped file is not truncated under the reader.
  explicit ZipArchive(const std::string& path) : path_(path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    check_user(fd >= 0, "cannot read " + path + ": " + std::strerror(errno) + ".", "check the path.");
    struct stat st {};
    const bool stat_ok = ::fstat(fd, &st) == 0;
    const int stat_errno = errno;
    if (stat_ok && S_ISREG(st.st_mode) && st.st_size > 0) {
      void* m = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_PRIVATE, fd, 0);
      if (m != MAP_FAILED) {
        map_ = m;
        bytes_ = std::string_view(static_cast<const char*>(m), static_cast<size_t>(st.st_size));
      }
    }
    ::close(fd);
    check_user(stat_ok, "cannot read " + path + ": " + std::strerror(stat_errno) + ".", "check the path.");
    read_directory();
  }
  ~ZipArchive() {
    if (map_) ::munmap(map_, bytes_.size());
  }
  ZipArchive(const ZipArchive&) = delete;
  ZipArchive& operator=(const ZipArchive&) = delete;

  bool has(const std::string& name) const { return records_.count(name) != 0; }
  uint64_t size(const std::string& name) const { return records_.at(name).size; }

  // The record's bytes, checked against its CRC-32.
  std::string_view get(const std::string& name) const {
    const Record& r = records_.at(name);
    const std::string_view data(bytes_.data() + r.offset, r.size);
    const auto crc = ::crc32_z(::crc32_z(0, nullptr, 0), reinterpret_cast<const Bytef*>(data.data()), data.size());
    check_user(crc == r.crc, "cannot read " + path_ + ": record " + name + " is damaged (CRC mismatch).",
               "the file is damaged; save it again.");
    return data;
  }

  // True if TorchScript wrote the archive (torch.jit.save, or LibTorch's
  // serialize::OutputArchive, as ddptrain's checkpoints of format 2 were).
  bool is_torchscript() const { return has("constants.pkl") || has("code/"); }

 private:
  struct Record {
    uint64_t offset = 0, size = 0;
    uint32_t crc = 0;
  };

  [[noreturn]] void broken(const std::string& why) const {
    throw UserError("cannot read " + path_ + ": not a complete PyTorch zip file (" + why + ").",
                    std::string("the file may be truncated or from PyTorch before 1.6; ") + kHint);
  }
  // n little-endian bytes at `at`, which must lie inside the file.
  uint64_t le(uint64_t at, size_t n) const {
    const auto b = span(at, n);
    uint64_t v = 0;
    for (size_t k = n; k-- > 0;) v = v << 8 | static_cast<uint8_t>(b[k]);
    return v;
  }
  std::string_view span(uint64_t at, uint64_t n) const {
    if (at > bytes_.size() || n > bytes_.size() - at) broken("a header reaches past the end of the file");
    return std::string_view(bytes_.data() + at, n);
  }
  bool signature(uint64_t at, uint32_t sig) const { return at + 4 <= bytes_.size() && le(at, 4) == sig; }

  void read_directory() {
    // The end-of-central-directory record: 22 bytes and a comment of up to
    // 64 KB at the end of the file.
    if (bytes_.size() < 22) broken("too short");
    uint64_t eocd = bytes_.size() - 22;
    const uint64_t lowest = eocd > 0xffff ? eocd - 0xffff : 0;
    while (!signature(eocd, 0x06054b50)) {
      if (eocd == lowest) broken("no end of central directory");
      --eocd;
    }
    uint64_t count = le(eocd + 10, 2), dir_size = le(eocd + 12, 4), dir_at = le(eocd + 16, 4);
    if (eocd >= 20 && signature(eocd - 20, 0x07064b50)) {  // the zip64 locator, then its record
      const uint64_t eocd64 = le(eocd - 20 + 8, 8);
      if (!signature(eocd64, 0x06064b50)) broken("a bad zip64 end of central directory");
      count = le(eocd64 + 32, 8);
      dir_size = le(eocd64 + 40, 8);
      dir_at = le(eocd64 + 48, 8);
    }
    if (dir_at > bytes_.size() || dir_size > bytes_.size() - dir_at) broken("the directory lies outside the file");
    if (count > dir_size / 46) broken("more records than the directory can hold");
    std::string prefix;
    std::vector<Extent> extents;
    uint64_t p = dir_at;
    for (uint64_t k = 0; k < count; ++k) {
      if (!signature(p, 0x02014b50)) broken("a bad directory entry");
      const uint64_t method = le(p + 10, 2), name_len = le(p + 28, 2), extra_len = le(p + 30, 2),
                     comment_len = le(p + 32, 2);
      Record r;
      r.crc = static_cast<uint32_t>(le(p + 16, 4));
      uint64_t packed = le(p + 20, 4), size = le(p + 24, 4), local = le(p + 42, 4);
      if (name_len == 0) broken("a record without a name");
      const std::string name(span(p + 46, name_len));
      for (uint64_t e = p + 46 + name_len; e + 4 <= p + 46 + name_len + extra_len;) {  // the zip64 sizes
        const uint64_t id = le(e, 2), len = le(e + 2, 2);
        uint64_t f = e + 4;
        if (id == 1) {
          if (size == 0xffffffff) size = le(f, 8), f += 8;
          if (packed == 0xffffffff) packed = le(f, 8), f += 8;
          if (local == 0xffffffff) local = le(f, 8);
        }
        e += 4 + len;
      }
      if (method != 0 || packed != size)
        broken("record " + name + " is compressed, which torch.save never does");
      if (!signature(local, 0x04034b50)) broken("record " + name + " has no local header");
      r.offset = local + 30 + le(local + 26, 2) + le(local + 28, 2);
      if (r.offset > bytes_.size() || size > bytes_.size() - r.offset)
        broken("record " + name + " declares " + std::to_string(size) + " bytes, more than the file holds");
      r.size = size;
      extents.push_back({local, r.offset + size, name});
      // Records live in one folder, named after the archive; the rest of
      // the name is what PyTorch looks up.
      const auto slash = name.find('/');
      if (k == 0) prefix = name.substr(0, slash == std::string::npos ? 0 : slash + 1);
      if (name.rfind(prefix, 0) == 0) records_[name.substr(prefix.size())] = r;
      if (name.rfind("code/", prefix.size()) == prefix.size()) records_["code/"] = r;
      p += 46 + name_len + extra_len + comment_len;
    }
    check_records_apart(extents, dir_at);
  }

  // Where a record lies in the file: its local header, then its bytes.
  struct Extent {
    uint64_t begin = 0, end = 0;
    std::string name;
  };

  // Every record is its own bytes, before the directory, under one name.
  // Then the storages a file can make the reader allocate (each at most its
  // record's size, each record read once) add up to at most the file's
  // size: directory entries that share a record, or a record placed inside
  // another, would each cost a full copy (issue 44: a 1.2 MB file asked for
  // 3 GB).
  void check_records_apart(std::vector<Extent>& extents, uint64_t dir_at) const {
    const std::string hint = "the file is damaged or was crafted; save the weights again with "
                             "torch.save(model.state_dict(), path) and use that file.";
    std::stable_sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) { return a.name < b.name; });
    for (size_t k = 1; k < extents.size(); ++k)
      check_user(extents[k].name != extents[k - 1].name,
                 "cannot read " + path_ + ": record " + extents[k].name + " is in the directory twice.", hint);
    std::stable_sort(extents.begin(), extents.end(),
                     [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
    for (size_t k = 0; k < extents.size(); ++k) {
      if (k > 0)
        check_user(extents[k].begin >= extents[k - 1].end,
                   "cannot read " + path_ + ": records " + extents[k - 1].name + " and " + extents[k].name +
                       " overlap (they share bytes of the file, which no zip writer does).",
                   hint);
      check_user(extents[k].end <= dir_at,
                 "cannot read " + path_ + ": record " + extents[k].name + " overlaps the zip directory.", hint);
    }
  }

  const std::string path_;
  void* map_ = nullptr;
  std::string_view bytes_;  // the mapped file (empty: an empty or unmappable file)
  std::map<std::string, Record> records_;
};

// `wanted` (null: all) picks the entries whose storages are read; the
// others are left out. Storages are allocated as the pickle names them and
// filled afterwards, only for the entries wanted (a storage shared by two
// names once).
NamedTensors read_zip(const std::string& path, const std::function<bool(const std::string&)>& wanted) {
  const ZipArchive zip(path);
  check_user(!zip.is_torchscript(),
             "cannot read " + path + ": it is a TorchScript archive (an older ddptrain checkpoint, format 2 or "
                                     "earlier, or a torch.jit.save file); ddptrain does not open those, since "
                                     "TorchScript's loader is unsafe for untrusted files.",
             "use a checkpoint written by this ddptrain, or weights saved with torch.save(model.state_dict(), path).");
  check_user(zip.has("data.pkl"),
             "cannot read " + path + ": the zip file has no data.pkl, so torch.save did not write it.", kHint);
  if (zip.has("byteorder"))
    check_user(zip.get("byteorder") == "little", "cannot read " + path + ": it was saved on a big-endian machine.",
               "load and save it again on a little-endian machine.");
  struct Pending {
    std::string record;
    torch::Tensor storage;
    bool filled = false;
  };
  std::vector<Pending> storages;
  std::unordered_map<const void*, size_t> storage_of;  // a storage's memory -> its entry in `storages`
  auto load_storage = [&](const std::string& key, c10::ScalarType dtype, int64_t numel) {
    const std::string record = "data/" + key;
    check_user(zip.has(record), "cannot read " + path + ": storage record " + record + " is missing.", kHint);
    check_user(numel >= 0, "cannot read " + path + ": storage " + record + " has a negative size.",
               "the file is damaged; save it again.");
    const uint64_t bytes = zip.size(record);
    const size_t item = c10::elementSize(dtype);
    // numel is compared by division first: a product could wrap around.
    check_user(static_cast<uint64_t>(numel) <= bytes / item && numel * item == bytes,
               "cannot read " + path + ": storage " + record + " has " + std::to_string(bytes) + " bytes, expected " +
                   std::to_string(numel) + " x " + c10::toString(dtype) + ".",
               "the file is damaged; save it again.");
    storages.push_back({record, torch::empty({numel}, torch::TensorOptions().dtype(dtype))});
    if (numel > 0) storage_of[storages.back().storage.storage().data()] = storages.size() - 1;
    return storages.back().storage;
  };
  // By the storage's memory, not a scan of all storages per tensor: a file
  // of many small storages would otherwise take quadratic time.
  auto fill = [&](const torch::Tensor& t) {
    const auto it = storage_of.find(t.storage().data());
    if (it == storage_of.end()) return;  // an empty storage: nothing to read
    Pending& p = storages[it->second];
    if (p.filled) return;
    const auto data = zip.get(p.record);
    std::memcpy(p.storage.data_ptr(), data.data(), data.size());
    p.filled = true;
  };
  const auto pkl = zip.get("data.pkl");
  Unpickler unpickler(path, reinterpret_cast<const uint8_t*>(pkl.data()), pkl.size(), load_storage);
  Value root = unpickler.run();
  check_user(root.kind == Value::kDict,
             "cannot read " + path + ": it holds a " + root.kind_name() + ", not a state_dict.", kHint);
  NamedTensors out;
  const auto& items = *root.items;
  for (size_t k = 0; k + 1 < items.size(); k += 2) {
    const Value &key = items[k], &value = items[k + 1];
    check_user(key.kind == Value::kString, "cannot read " + path + ": a key is a " + key.kind_name() + ", not a name.",
               kHint);
    check_user(value.kind == Value::kTensor,
               "cannot read " + path + ": '" + key.s() + "' holds a " + value.kind_name() + ", not a tensor.",
               "save only the model's state_dict, e.g. torch.save(checkpoint['model'], path).");
    if (wanted && !wanted(key.s())) continue;
    fill(value.tensor);
    out.emplace_back(key.s(), value.tensor);
  }
  return out;
}

}  // namespace

NamedTensors read_state_dict(const std::string& path) { return read_zip(path, nullptr); }

NamedTensors read_state_dict(const std::string& path, const std::function<bool(const std::string&)>& wanted) {
  return read_zip(path, wanted);
}

void write_state_dict(const std::string& path, const NamedTensors& tensors) {
  Pickler p;
  p.op(0x80);  // PROTO 2
  p.op(2);
  p.new_ordered_dict();
  std::vector<torch::Tensor> storages;
  // A tensor listed under two names (a tied embedding and output head) is
  // written once and referenced twice, as torch.save shares the storage:
  // the same memory, dtype, sizes and strides is the same tensor.
  std::vector<torch::Tensor> originals;
  auto written_as = [&](const torch::Tensor& x) {
    for (size_t k = 0; k < originals.size(); ++k) {
      const auto& o = originals[k];
      if (x.numel() > 0 && o.data_ptr() == x.data_ptr() && o.scalar_type() == x.scalar_type() &&
          o.device() == x.device() && o.sizes() == x.sizes() && o.strides() == x.strides())
        return k;
    }
    return originals.size();
  };
  if (!tensors.empty()) p.op('(');
  for (const auto& [name, tensor] : tensors) {
    const size_t key = written_as(tensor);
    const bool fresh = key == originals.size();
    auto t = fresh ? tensor.detach().to(torch::kCPU).contiguous() : storages[key];
    std::string storage_type;
    for (const auto& [type, dtype] : storage_types())
      if (dtype == t.scalar_type()) storage_type = type;
    check_user(!storage_type.empty() && t.layout() == torch::kStrided,
               "cannot export '" + name + "': tensors of type " + c10::toString(t.scalar_type()) +
                   " are not supported.",
               "convert it to a float or integer type first.");
    // Row-major strides of a fresh storage that holds just this tensor.
    std::vector<int64_t> stride(t.dim(), 1);
    for (int64_t d = t.dim() - 2; d >= 0; --d) stride[d] = stride[d + 1] * std::max<int64_t>(t.size(d + 1), 1);
    p.string(name);
    p.global("torch._utils", "_rebuild_tensor_v2");
    p.op('(');
    p.op('(');  // persistent id ('storage', torch.<Type>Storage, key, 'cpu', numel)
    p.string("storage");
    p.global("torch", storage_type);
    p.string(std::to_string(key));
    p.string("cpu");
    p.integer(t.numel());
    p.op('t');
    p.op('Q');           // BINPERSID
    p.integer(0);        // storage offset
    p.ints(t.sizes());
    p.ints(stride);
    p.op(0x89);          // requires_grad=False
    p.new_ordered_dict();  // backward_hooks
    p.op('t');
    p.op('R');
    if (fresh) {
      originals.push_back(tensor);
      storages.push_back(t);
    }
  }
  if (!tensors.empty()) p.op('u');  // SETITEMS
  p.op('.');                        // STOP

  std::string zip_bytes;
  const std::function<size_t(const void*, size_t)> append = [&](const void* data, size_t n) {
    zip_bytes.append(static_cast<const char*>(data), n);
    return n;
  };
  {
    caffe2::serialize::PyTorchStreamWriter zip(append);
    zip.writeRecord("byteorder", "little", 6);  // PyTorch 2.x writes it; 1.13 ignores it
    zip.writeRecord("data.pkl", p.bytes.data(), p.bytes.size());
    for (size_t k = 0; k < storages.size(); ++k) {
      const auto& t = storages[k];
      zip.writeRecord("data/" + std::to_string(k), t.numel() ? t.data_ptr() : "", t.nbytes());
    }
    zip.writeEndOfFile();  // also writes the format version record
  }
  write_file_atomic(path, zip_bytes);
}

}  // namespace ddp
