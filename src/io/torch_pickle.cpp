// A minimal pickle reader and writer for torch.save state_dict files.
//
// caffe2::serialize's zip reader and writer need no shim in compat.h: the
// calls used here (Reader(path), hasRecord, getRecord(name) returning
// tuple<DataPtr, size_t>, Writer(std::function<size_t(const void*, size_t)>),
// writeRecord, writeEndOfFile) read the same in LibTorch 1.13 and 2.x, which
// only adds defaulted arguments (an allocator, crc32, alignment).
#include "ddp/io/torch_pickle.h"

#include <caffe2/serialize/inline_container.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
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

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

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
  std::string s;         // string; "module.name" of a global; a storage's key
  std::shared_ptr<std::vector<Value>> items;  // tuple, list; a dict as key, value, key, value...
  torch::Tensor tensor;  // a tensor, or a storage as a 1-D tensor of its dtype

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
          push(global(module.s, name.s));
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
          push(call(fn.s, *args.items, at));
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
    Value v = Value::of(Value::kString);
    const uint8_t* p = take(n);
    v.s.assign(reinterpret_cast<const char*>(p), n);
    return v;
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
    Value v = Value::of(Value::kGlobal);
    v.s = full;
    return v;
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
    int64_t last = offset;  // the last element the view touches
    bool empty = false;
    for (size_t d = 0; d < size.size(); ++d) {
      empty = empty || size[d] == 0;
      last += (size[d] - 1) * stride[d];
    }
    if (offset < 0 || (!empty && last >= storage.numel()) || offset > storage.numel())
      fail("a tensor reaches past the end of storage '" + args[0].s + "'", at);
    Value v = Value::of(Value::kTensor);
    v.tensor = torch::empty({0}, storage.options()).set_(storage.storage(), offset, size, stride);
    return v;
  }

  // ('storage', torch.<Type>Storage, key, location, numel): loaded once per
  // key, so that views of one storage share it as they did in Python.
  Value persistent_load(const Value& pid, size_t at) {
    const auto* t = pid.kind == Value::kTuple ? pid.items.get() : nullptr;
    if (!t || t->size() != 5 || (*t)[0].kind != Value::kString || (*t)[0].s != "storage" ||
        (*t)[1].kind != Value::kGlobal || (*t)[2].kind != Value::kString || !is_int((*t)[4]))
      fail("a persistent id that is not a tensor storage", at);
    const std::string& key = (*t)[2].s;
    auto it = storages_.find(key);
    if (it == storages_.end()) {
      c10::ScalarType dtype = c10::kFloat;
      bool found = false;
      for (const auto& [name, type] : storage_types()) {
        if ((*t)[1].s == "torch." + name) {
          dtype = type;
          found = true;
        }
      }
      if (!found) fail("the storage type '" + (*t)[1].s + "' is not supported", at);
      it = storages_.emplace(key, load_(key, dtype, (*t)[4].i)).first;
    }
    Value v = Value::of(Value::kStorage);
    v.s = key;
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

NamedTensors read_zip(const std::string& path) {
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> zip;
  try {
    zip = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
  } catch (const std::exception& e) {
    throw UserError("cannot read " + path + ": not a complete PyTorch zip file (" + first_line(e.what()) + ").",
                    std::string("the file may be truncated or from PyTorch before 1.6; ") + kHint);
  }
  check_user(zip->hasRecord("data.pkl"),
             "cannot read " + path + ": the zip file has no data.pkl, so torch.save did not write it (a TorchScript "
                                     "model or another archive?).",
             kHint);
  if (zip->hasRecord("byteorder")) {
    auto [data, n] = zip->getRecord("byteorder");
    check_user(std::string(static_cast<const char*>(data.get()), n) == "little",
               "cannot read " + path + ": it was saved on a big-endian machine.",
               "load and save it again on a little-endian machine.");
  }
  auto load_storage = [&](const std::string& key, c10::ScalarType dtype, int64_t numel) {
    const std::string record = "data/" + key;
    check_user(zip->hasRecord(record), "cannot read " + path + ": storage record " + record + " is missing.", kHint);
    auto [data, n] = zip->getRecord(record);
    const size_t expected = static_cast<size_t>(numel) * c10::elementSize(dtype);
    check_user(numel >= 0 && n == expected,
               "cannot read " + path + ": storage " + record + " has " + std::to_string(n) + " bytes, expected " +
                   std::to_string(expected) + " (" + std::to_string(numel) + " x " + c10::toString(dtype) + ").",
               "the file is damaged; save it again.");
    auto storage = torch::empty({numel}, torch::TensorOptions().dtype(dtype));
    if (n) std::memcpy(storage.data_ptr(), data.get(), n);
    return storage;
  };
  auto [pkl, pkl_size] = zip->getRecord("data.pkl");
  Unpickler unpickler(path, static_cast<const uint8_t*>(pkl.get()), pkl_size, load_storage);
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
               "cannot read " + path + ": '" + key.s + "' holds a " + value.kind_name() + ", not a tensor.",
               "save only the model's state_dict, e.g. torch.save(checkpoint['model'], path).");
    out.emplace_back(key.s, value.tensor);
  }
  return out;
}

}  // namespace

NamedTensors read_state_dict(const std::string& path) {
  try {
    return read_zip(path);
  } catch (const c10::Error& e) {  // a record that does not decompress or fails its checksum
    throw UserError("cannot read " + path + ": the zip file is damaged (" + first_line(e.what()) + ").",
                    "save it again with torch.save(model.state_dict(), path).");
  }
}

void write_state_dict(const std::string& path, const NamedTensors& tensors) {
  Pickler p;
  p.op(0x80);  // PROTO 2
  p.op(2);
  p.new_ordered_dict();
  std::vector<torch::Tensor> storages;
  if (!tensors.empty()) p.op('(');
  for (const auto& [name, tensor] : tensors) {
    auto t = tensor.detach().to(torch::kCPU).contiguous();
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
    p.string(std::to_string(storages.size()));
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
    storages.push_back(t);
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
