// expert_arena._core: tensor streaming (producer, reservation, consumer, opened tensors).
#include "binding.h"

#include "expert_arena/metrics.h"

namespace expert_arena::python {
namespace {

// ---- Streaming --------------------------------------------------------------------------

// The bytes the views point into (the consumer's copy-on-write mapping, made on first use).
std::span<std::byte> PrivateBytes(const StreamTensor& t) {
  Result<std::span<std::byte>> bytes = t.private_bytes();
  if (!bytes.ok()) RaiseStatus(bytes.status());
  return *bytes;
}

py::dict StatsDict(const StreamStats& s) {
  py::dict d;
  d["total_bytes"] = s.total_bytes;
  d["free_bytes"] = s.free_bytes;
  d["largest_free_block"] = s.largest_free_block;
  d["segments"] = s.segments;
  d["dedicated_segments"] = s.dedicated_segments;
  d["live_blocks"] = s.live_blocks;
  d["pinned_bytes"] = s.pinned_bytes;
  d["spills"] = s.spills;
  d["spill_files"] = s.spill_files;
  d["fragmentation_failures"] = s.fragmentation_failures;
  d["reclaimed_blocks"] = s.reclaimed_blocks;
  d["dead_readers_cleared"] = s.dead_readers_cleared;
  d["segments_grown_ahead"] = s.segments_grown_ahead;
  d["remote_admitted"] = s.remote_admitted;
  d["remote_refused"] = s.remote_refused;
  d["remote_timed_out"] = s.remote_timed_out;
  d["remote_dropped"] = s.remote_dropped;
  d["remote_auth_failed"] = s.remote_auth_failed;
  d["remote_restarts"] = s.remote_restarts;
  d["numa"] = s.numa;
  d["numa_node"] = s.numa_node;
  return d;
}

// Space reserved in a segment, written in place through writable views, then published.
// The views and the Python Reservation share the C++ Reservation: unpublished, its space goes
// back when the last of them is gone (cancel() drops only the handle's share), so no view ever
// writes into space another tensor was given; it also keeps the producer's segments mapped.
struct HeldReservation {
  Reservation reservation;
};

class PyReservation {
 public:
  PyReservation(Reservation reservation, std::string key)
      : key_(std::move(key)),
        bytes_(reservation.bytes()),
        spilled_(reservation.spilled()),
        held_(std::make_shared<HeldReservation>(HeldReservation{std::move(reservation)})) {}

  const std::shared_ptr<HeldReservation>& Get() const {
    if (!held_) {
      throw py::value_error("reservation of key " + key_ +
                            (published_ ? " was published: write before publish(), and make a "
                                          "new reservation for the next tensor"
                                        : " was cancelled"));
    }
    return held_;
  }

  py::array View(const py::dtype& dtype, const std::vector<py::ssize_t>& shape) const {
    return TypedArray(std::span<const std::byte>(bytes_), Get(), true, dtype, shape,
                      "reservation of key " + key_);
  }

  py::bytes Publish(const std::string& dtype, const std::vector<int64_t>& shape, uint32_t readers) {
    const auto& held = Get();
    TensorInfo info;
    info.dtype = dtype;
    info.shape = ShapeFrom(shape);
    Result<std::string> descriptor = held->reservation.Publish(info, readers);
    if (descriptor.ok() || descriptor.status().code() == StatusCode::kBusy) {
      // Published, or aborted meanwhile (its space given back): either way it is done.
      published_ = descriptor.ok();
      held_.reset();
    }
    return py::bytes(Take(std::move(descriptor)));
  }

  void Cancel() { held_.reset(); }
  bool published() const { return published_; }
  bool open() const { return held_ != nullptr; }
  bool spilled() const { return spilled_; }
  uintptr_t Address() const { return reinterpret_cast<uintptr_t>(bytes_.data()); }
  uint64_t nbytes() const { return bytes_.size(); }

 private:
  std::string key_;
  std::span<std::byte> bytes_;
  bool spilled_ = false;
  bool published_ = false;
  std::shared_ptr<HeldReservation> held_;
};

class PyProducer {
 public:
  PyProducer(const std::string& directory, const std::string& logical_name, uint64_t segment_bytes,
             uint32_t max_segments, bool strict, double strict_wait_seconds, const std::string& gpu,
             uint64_t pin_budget_bytes, uint64_t block_alignment,
             const std::string& spill_directory, const std::string& huge, uint32_t copy_threads,
             bool grow_ahead, bool sweep_at_start, bool quiet, double lease_check_seconds,
             const std::string& listen, const std::string& listen_token,
             double remote_lease_seconds, uint64_t non_temporal_copy_from,
             double warning_interval_seconds, const std::string& numa,
             bool listen_allow_no_token) {
    StreamOptions options;
    options.listen_allow_no_token = listen_allow_no_token;
    if (Status s = ParseNumaPlacement(numa, &options.numa, &options.numa_node); !s.ok()) {
      throw py::value_error("StreamProducer(): numa=" + s.message());
    }
    options.non_temporal_copy_from = non_temporal_copy_from;
    options.warning_interval_seconds = warning_interval_seconds;
    options.listen = listen;
    options.listen_token = listen_token;
    options.remote_lease_seconds = remote_lease_seconds;
    options.directory = directory;
    options.logical_name = logical_name;
    options.segment_bytes = segment_bytes;
    options.max_segments = max_segments;
    options.strict = strict;
    options.strict_wait_seconds = strict_wait_seconds;
    options.gpu = ParseGpu(gpu);
    options.pin_budget_bytes = pin_budget_bytes;
    options.block_alignment = block_alignment;
    options.spill_directory = spill_directory;
    options.huge = ParseHuge(huge);
    options.copy_threads = copy_threads;
    options.grow_ahead = grow_ahead;
    options.sweep_at_start = sweep_at_start;
    options.lease_check_seconds = lease_check_seconds;
    if (quiet) options.logger = QuietLogger();
    std::optional<Result<StreamProducer>> producer;
    {
      py::gil_scoped_release release;
      producer.emplace(StreamProducer::Create(options));
    }
    producer_ = std::make_shared<StreamProducer>(Take(std::move(*producer)));
  }

  std::shared_ptr<StreamProducer> Get() const {
    if (!producer_) RaiseClosed("StreamProducer");
    return producer_;
  }

  // Copies `nbytes` at `address` (a contiguous CPU buffer the caller keeps alive for the
  // call) into a segment and publishes it.
  py::bytes Put(const std::string& key, uintptr_t address, uint64_t nbytes,
                const std::string& dtype, const std::vector<int64_t>& shape, uint32_t readers) {
    auto producer = Get();
    TensorInfo info;
    info.dtype = dtype;
    info.shape = ShapeFrom(shape);
    std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(address), nbytes);
    std::optional<Result<std::string>> descriptor;
    {
      py::gil_scoped_release release;
      descriptor.emplace(producer->Put(key, bytes, info, readers));
    }
    return py::bytes(Take(std::move(*descriptor)));
  }

  // Put of a batch, all or none (StreamProducer::PutMany): `items` is a list of
  // (key, address, nbytes, dtype, shape) tuples whose buffers the caller keeps alive.
  py::list PutMany(const py::list& items, uint32_t readers) {
    auto producer = Get();
    const size_t n = items.size();
    std::vector<std::string> keys(n);
    std::vector<PutItem> puts(n);
    for (size_t i = 0; i < n; ++i) {
      py::handle item = items[i];
      if (!PyTuple_Check(item.ptr()) || PyTuple_GET_SIZE(item.ptr()) != 5) {
        throw py::type_error("put_many: item " + std::to_string(i) +
                             " is not a (key, address, nbytes, dtype, shape) tuple");
      }
      py::tuple t = py::reinterpret_borrow<py::tuple>(item);
      keys[i] = t[0].cast<std::string>();
      puts[i].key = keys[i];
      puts[i].bytes = std::span<const std::byte>(
          reinterpret_cast<const std::byte*>(t[1].cast<uintptr_t>()), t[2].cast<uint64_t>());
      puts[i].info.dtype = t[3].cast<std::string>();
      puts[i].info.shape = ShapeFrom(t[4].cast<std::vector<int64_t>>());
    }
    std::optional<Result<std::vector<std::string>>> descriptors;
    {
      py::gil_scoped_release release;
      descriptors.emplace(producer->PutMany(puts, readers));
    }
    std::vector<std::string> out = Take(std::move(*descriptors));
    py::list list(out.size());
    for (size_t i = 0; i < out.size(); ++i) list[i] = py::bytes(out[i]);
    return list;
  }

  // put_many from the caller's (key, tensor) pairs. A C-contiguous NumPy array of a dtype in
  // `numpy_names`, and a CPU, strided, contiguous torch tensor (`torch_type`, `strided`) of a
  // dtype in `torch_names`, are read here, with no Python code run per item; anything else is
  // handed to `slow(index, key, object)`, which returns (address, nbytes, dtype, shape) or
  // raises the error that names what the object is. `pairs` keeps every buffer alive.
  py::list PutManyPairs(const py::list& pairs, uint32_t readers, const py::dict& numpy_names,
                        const py::object& torch_type, const py::object& strided,
                        const py::dict& torch_names, const py::object& slow) {
    auto producer = Get();
    static const py::str kIsCpu("is_cpu"), kLayout("layout"), kIsContiguous("is_contiguous"),
        kDtype("dtype"), kDataPtr("data_ptr"), kShape("shape");
    const size_t n = pairs.size();
    std::vector<std::string> keys(n), dtypes(n);
    std::vector<PutItem> puts(n);
    for (size_t i = 0; i < n; ++i) {
      PyObject* pair = PyList_GET_ITEM(pairs.ptr(), static_cast<py::ssize_t>(i));
      if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        throw py::type_error("put_many(): item " + std::to_string(i) +
                             " is not a (key, tensor) pair: " + Py_TYPE(pair)->tp_name);
      }
      PyObject* key = PyTuple_GET_ITEM(pair, 0);
      py::handle tensor = PyTuple_GET_ITEM(pair, 1);
      py::ssize_t key_size = 0;
      const char* key_data =
          PyUnicode_Check(key) ? PyUnicode_AsUTF8AndSize(key, &key_size) : nullptr;
      if (key_data == nullptr) {
        PyErr_Clear();
        throw py::type_error("put_many(): the key of item " + std::to_string(i) +
                             " is not a str: " + Py_TYPE(key)->tp_name);
      }
      keys[i].assign(key_data, static_cast<size_t>(key_size));
      PutItem& put = puts[i];
      bool done = false;
      if (py::isinstance<py::array>(tensor)) {
        auto array = py::reinterpret_borrow<py::array>(tensor);
        PyObject* name = PyDict_GetItem(numpy_names.ptr(), array.dtype().ptr());
        if (name != nullptr && (array.flags() & py::array::c_style) != 0) {
          dtypes[i] = py::reinterpret_borrow<py::str>(name);
          // The element size from the dtype's stream name, not array.nbytes() (binding.h,
          // ItemSize: wrong under NumPy 2 with pybind11 < 2.12).
          put.bytes = std::span<const std::byte>(
              static_cast<const std::byte*>(array.data()),
              static_cast<size_t>(array.size()) * ElementBytes(dtypes[i]));
          put.info.shape.assign(array.shape(), array.shape() + array.ndim());
          done = true;
        }
      } else if (!torch_type.is_none() &&
                 PyObject_TypeCheck(tensor.ptr(),
                                    reinterpret_cast<PyTypeObject*>(torch_type.ptr())) &&
                 tensor.attr(kIsCpu).ptr() == Py_True &&
                 tensor.attr(kLayout).ptr() == strided.ptr() &&
                 tensor.attr(kIsContiguous)().ptr() == Py_True) {
        PyObject* name = PyDict_GetItem(torch_names.ptr(), tensor.attr(kDtype).ptr());
        if (name != nullptr) {
          dtypes[i] = py::reinterpret_borrow<py::str>(name);
          py::tuple shape = py::tuple(tensor.attr(kShape));
          uint64_t count = 1;
          put.info.shape.reserve(shape.size());
          for (py::handle d : shape) {
            put.info.shape.push_back(d.cast<uint64_t>());
            count *= put.info.shape.back();
          }
          uint64_t item_size = ElementBytes(dtypes[i]);
          put.bytes = std::span<const std::byte>(
              reinterpret_cast<const std::byte*>(tensor.attr(kDataPtr)().cast<uintptr_t>()),
              count * item_size);
          done = item_size != 0;
        }
      }
      if (!done) {
        py::tuple source = slow(i, py::handle(key), tensor);
        put.bytes = std::span<const std::byte>(
            reinterpret_cast<const std::byte*>(source[0].cast<uintptr_t>()),
            source[1].cast<uint64_t>());
        dtypes[i] = source[2].cast<std::string>();
        put.info.shape = ShapeFrom(source[3].cast<std::vector<int64_t>>());
      }
      put.key = keys[i];
      put.info.dtype = dtypes[i];
    }
    std::optional<Result<std::vector<std::string>>> descriptors;
    {
      py::gil_scoped_release release;
      descriptors.emplace(producer->PutMany(puts, readers));
    }
    std::vector<std::string> out = Take(std::move(*descriptors));
    py::list list(out.size());
    for (size_t i = 0; i < out.size(); ++i) {
      PyObject* b =
          PyBytes_FromStringAndSize(out[i].data(), static_cast<py::ssize_t>(out[i].size()));
      if (b == nullptr) throw py::error_already_set();
      PyList_SET_ITEM(list.ptr(), static_cast<py::ssize_t>(i), b);
    }
    return list;
  }

  PyReservation Reserve(const std::string& key, uint64_t nbytes) {
    auto producer = Get();
    std::optional<Result<Reservation>> reservation;
    {
      py::gil_scoped_release release;
      reservation.emplace(producer->Reserve(key, nbytes));
    }
    return PyReservation(Take(std::move(*reservation)), key);
  }

  uint64_t Abort(const std::string& key) {
    auto producer = Get();
    std::optional<Result<uint64_t>> marked;
    {
      py::gil_scoped_release release;
      marked.emplace(producer->Abort(key));
    }
    return Take(std::move(*marked));
  }

  void Reclaim() {
    auto producer = Get();
    Status s;
    {
      py::gil_scoped_release release;
      s = producer->Reclaim();
    }
    if (!s.ok()) RaiseStatus(s);
  }

  py::dict Stats() {
    auto producer = Get();
    std::optional<Result<StreamStats>> s;
    {
      py::gil_scoped_release release;
      s.emplace(producer->Stats());
    }
    if (!s->ok()) RaiseStatus(s->status());
    return StatsDict(**s);
  }

  // [{key, state, age_seconds, readers_left, holders, bytes, segment, spilled,
  //   remote_holders}], oldest first.
  py::list Pending() {
    auto producer = Get();
    std::optional<Result<std::vector<PendingBlock>>> pending;
    {
      py::gil_scoped_release release;
      pending.emplace(producer->Pending());
    }
    std::vector<PendingBlock> blocks = Take(std::move(*pending));
    py::list out;
    for (const PendingBlock& b : blocks) {
      py::dict d;
      d["key"] = b.key;
      d["state"] = b.state;
      d["age_seconds"] = b.age_seconds;
      d["readers_left"] = b.readers_left;
      d["holders"] = b.holders;
      d["bytes"] = b.bytes;
      d["segment"] = b.segment;
      d["spilled"] = b.spilled;
      d["remote_holders"] = b.remote_holders;
      out.append(std::move(d));
    }
    return out;
  }

  std::vector<std::string> SegmentPaths() { return Get()->SegmentPaths(); }
  py::dict SegmentNodes() {
    py::dict d;
    for (const NumaNodeBytes& n : Get()->SegmentNodeBytes()) d[py::int_(n.node)] = n.bytes;
    return d;
  }
  std::string InstanceName() { return Get()->instance_name(); }
  std::string RemoteAddress() { return Get()->remote_address(); }
  bool closed() const { return producer_ == nullptr; }

  void Close() {
    std::shared_ptr<StreamProducer> producer = std::move(producer_);
    py::gil_scoped_release release;
    producer.reset();
  }

 private:
  std::shared_ptr<StreamProducer> producer_;
};

// One opened tensor: the views and the Python StreamTensor share it; the reader's share goes
// back to the producer when the last of them is gone.
struct OpenedTensor {
  StreamTensor tensor;
};

class PyStreamTensor {
 public:
  explicit PyStreamTensor(StreamTensor tensor)
      : descriptor_(tensor.descriptor()),
        opened_(std::make_shared<OpenedTensor>(OpenedTensor{std::move(tensor)})) {}

  const std::shared_ptr<OpenedTensor>& Get() const {
    if (!opened_) {
      throw py::value_error("stream tensor " + descriptor_.key + " was released");
    }
    return opened_;
  }

  py::array Buffer(bool writable) const {
    const auto& opened = Get();
    return ByteArray(PrivateBytes(opened->tensor), opened, writable);
  }

  // A read-only (or writable) C-contiguous array of `dtype` and `shape` over the bytes, made in
  // one step (the caller's layout has checked that dtype and shape cover exactly the bytes).
  py::array View(bool writable, const py::dtype& dtype,
                 const std::vector<py::ssize_t>& shape) const {
    const auto& opened = Get();
    return TypedArray(PrivateBytes(opened->tensor), opened, writable, dtype, shape,
                      "stream tensor " + descriptor_.key);
  }

  void Release() { opened_.reset(); }
  bool released() const { return opened_ == nullptr; }
  const TensorDescriptor& descriptor() const { return descriptor_; }
  uintptr_t Address() const {
    return reinterpret_cast<uintptr_t>(PrivateBytes(Get()->tensor).data());
  }

 private:
  TensorDescriptor descriptor_;
  std::shared_ptr<OpenedTensor> opened_;
};

class PyConsumer {
 public:
  PyConsumer(const std::string& directory, const std::string& spill_directory,
             const std::string& gpu, uint64_t pin_budget_bytes, bool allow_foreign_owner,
             bool quiet, const std::string& remote_token, double remote_timeout_seconds,
             bool remote_allow_no_token) {
    ConsumerOptions options;
    options.remote_allow_no_token = remote_allow_no_token;
    options.remote_token = remote_token;
    options.remote_timeout_seconds = remote_timeout_seconds;
    options.directory = directory;
    options.spill_directory = spill_directory;
    options.gpu = ParseGpu(gpu);
    options.pin_budget_bytes = pin_budget_bytes;
    options.allow_foreign_owner = allow_foreign_owner;
    if (quiet) options.logger = QuietLogger();
    std::optional<Result<StreamConsumer>> consumer;
    {
      py::gil_scoped_release release;
      consumer.emplace(StreamConsumer::Create(options));
    }
    consumer_ = std::make_shared<StreamConsumer>(Take(std::move(*consumer)));
  }

  std::shared_ptr<StreamConsumer> Get() const {
    if (!consumer_) RaiseClosed("StreamConsumer");
    return consumer_;
  }

  PyStreamTensor Open(const py::bytes& descriptor) {
    auto consumer = Get();
    // A view of the bytes object's buffer: the caller's reference keeps it alive meanwhile.
    std::string_view wire = BytesView(descriptor.ptr(), "open");
    std::optional<Result<StreamTensor>> tensor;
    {
      py::gil_scoped_release release;
      tensor.emplace(consumer->Open(wire));
    }
    return PyStreamTensor(Take(std::move(*tensor)));
  }

  // Opens every descriptor of `descriptors` (bytes objects the caller keeps alive) with the
  // GIL released once, all or none (StreamConsumer::OpenMany): when one fails, those opened
  // before it are given back unread, without spending their shares (each opens again), and the
  // error names its index.
  std::vector<StreamTensor> OpenAll(const py::list& descriptors) {
    auto consumer = Get();
    const size_t n = descriptors.size();
    std::vector<std::string_view> wires(n);
    for (size_t i = 0; i < n; ++i) wires[i] = BytesView(descriptors[i].ptr(), "open_many");
    std::optional<Result<std::vector<StreamTensor>>> opened;
    {
      py::gil_scoped_release release;
      opened.emplace(consumer->OpenMany(wires));
    }
    return Take(std::move(*opened));
  }

  // Open of a batch, all or none: [(handle, key, dtype, shape, nbytes), ...] in order.
  py::list OpenManySummary(const py::list& descriptors) {
    std::vector<StreamTensor> opened = OpenAll(descriptors);
    py::list out(opened.size());
    for (size_t i = 0; i < opened.size(); ++i) {
      out[i] = Summary(PyStreamTensor(std::move(opened[i])));
    }
    return out;
  }

  // Open of a batch straight to read-only NumPy arrays, all or none: each array's base holds
  // its opened tensor, so the reader's share goes back when the array (and every view of it)
  // is gone. `layouts` maps a lower-case dtype name to its NumPy dtype (_dtypes); a name not
  // in it gives the raw bytes as uint8.
  //
  // With `for_torch` the arrays are writable (the package wraps each in a read-only tensor and
  // never hands the array out), and a tensor whose dtype is not in `layouts` comes as a
  // (uint8 array of its bytes, dtype, shape, key) tuple for the package to view.
  py::list OpenManyArrays(const py::list& descriptors, const py::dict& layouts, bool for_torch) {
    std::vector<StreamTensor> tensors = OpenAll(descriptors);
    const size_t n = tensors.size();
    std::vector<std::shared_ptr<OpenedTensor>> opened;
    opened.reserve(n);
    for (StreamTensor& t : tensors) {
      opened.push_back(std::make_shared<OpenedTensor>(OpenedTensor{std::move(t)}));
    }
    static const py::dtype kBytes = py::dtype::of<uint8_t>();
    py::list out(n);
    std::string lower;
    std::vector<py::ssize_t> shape;
    for (size_t i = 0; i < n; ++i) {
      const TensorDescriptor& d = opened[i]->tensor.descriptor();
      std::span<const std::byte> bytes = PrivateBytes(opened[i]->tensor);
      lower.assign(d.dtype);
      for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      PyObject* dtype = PyDict_GetItemString(layouts.ptr(), lower.c_str());
      shape.clear();
      if (dtype != nullptr) {
        shape.assign(d.shape.begin(), d.shape.end());
        out[i] = TypedArray(bytes, opened[i], for_torch, py::reinterpret_borrow<py::dtype>(dtype),
                            shape, "stream tensor " + d.key + " (" + d.dtype + ")");
      } else {
        shape.push_back(static_cast<py::ssize_t>(bytes.size()));
        py::array raw =
            TypedArray(bytes, opened[i], for_torch, kBytes, shape, "stream tensor " + d.key);
        if (for_torch) {
          out[i] = py::make_tuple(raw, py::str(d.dtype), Shape(d.shape), py::str(d.key));
        } else {
          out[i] = raw;
        }
      }
    }
    return out;
  }

  // Open plus the summary in one call: (handle, key, dtype, shape, nbytes).
  py::tuple OpenSummary(const py::bytes& descriptor) { return Summary(Open(descriptor)); }

  static py::tuple Summary(PyStreamTensor tensor) {
    const TensorDescriptor& d = tensor.descriptor();
    py::str key(d.key);
    py::str dtype(d.dtype);
    py::tuple shape = Shape(d.shape);
    py::int_ length(d.length);
    return py::make_tuple(py::cast(std::move(tensor)), key, dtype, shape, length);
  }

  uint64_t PollReleases() {
    auto consumer = Get();
    py::gil_scoped_release release;
    return consumer->PollReleases();
  }

  py::dict Stats() {
    ConsumerStats s = Get()->Stats();
    py::dict d;
    d["mapped_segments"] = s.mapped_segments;
    d["mapped_bytes"] = s.mapped_bytes;
    d["pinned_bytes"] = s.pinned_bytes;
    d["open_views"] = s.open_views;
    d["deferred_releases"] = s.deferred_releases;
    d["dropped_segments"] = s.dropped_segments;
    return d;
  }

  bool closed() const { return consumer_ == nullptr; }

  void Close() {
    std::shared_ptr<StreamConsumer> consumer = std::move(consumer_);
    py::gil_scoped_release release;
    consumer.reset();
  }

 private:
  std::shared_ptr<StreamConsumer> consumer_;
};

py::dict DescriptorDict(const TensorDescriptor& d) {
  py::dict out;
  out["segment"] = d.segment;
  out["spilled"] = d.spilled;
  out["slot"] = d.slot;
  out["generation"] = d.generation;
  out["offset"] = d.offset;
  out["length"] = d.length;
  out["dtype"] = d.dtype;
  out["shape"] = Shape(d.shape);
  out["key"] = d.key;
  if (!d.remote.empty()) {  // a listening producer's (docs/cross-host.md)
    out["remote"] = d.remote;
    out["producer_instance"] = d.producer_instance;
    out["boot_id"] = d.boot_id;
  }
  return out;
}

py::dict SegmentDict(const SegmentInfo& s) {
  py::dict d;
  d["path"] = s.path;
  d["ours"] = s.ours;
  d["problem"] = s.problem;
  d["owner_pid"] = s.owner_pid;
  d["owner_start_time"] = s.owner_start_time;
  d["owner_uid"] = s.owner_uid;
  d["owner_alive"] = s.owner_alive;
  d["dedicated"] = s.dedicated;
  d["spill"] = s.spill;
  d["logical_name"] = s.logical_name;
  d["file_bytes"] = s.file_bytes;
  d["data_bytes"] = s.data_bytes;
  d["slots"] = s.slots;
  d["live_blocks"] = s.live_blocks;
  d["live_bytes"] = s.live_bytes;
  d["published_blocks"] = s.published_blocks;
  d["aborted_blocks"] = s.aborted_blocks;
  d["readers"] = s.readers;
  return d;
}

}  // namespace

void BindStream(py::module_& m) {
  py::class_<PyProducer>(m, "StreamProducer")
      .def(py::init<const std::string&, const std::string&, uint64_t, uint32_t, bool, double,
                    const std::string&, uint64_t, uint64_t, const std::string&, const std::string&,
                    uint32_t, bool, bool, bool, double, const std::string&, const std::string&,
                    double, uint64_t, double, const std::string&, bool>(),
           py::arg("directory"), py::arg("logical_name"), py::arg("segment_bytes"),
           py::arg("max_segments"), py::arg("strict"), py::arg("strict_wait_seconds"),
           py::arg("gpu"), py::arg("pin_budget_bytes"), py::arg("block_alignment"),
           py::arg("spill_directory"), py::arg("huge"), py::arg("copy_threads"),
           py::arg("grow_ahead"), py::arg("sweep_at_start"), py::arg("quiet"),
           py::arg("lease_check_seconds"), py::arg("listen"), py::arg("listen_token"),
           py::arg("remote_lease_seconds"), py::arg("non_temporal_copy_from") = 0,
           py::arg("warning_interval_seconds") = 10.0, py::arg("numa") = "auto",
           py::arg("listen_allow_no_token") = false)
      .def("put", &PyProducer::Put, py::arg("key"), py::arg("address"), py::arg("nbytes"),
           py::arg("dtype"), py::arg("shape"), py::arg("readers"))
      .def("put_many", &PyProducer::PutMany, py::arg("items"), py::arg("readers"))
      .def("put_many_pairs", &PyProducer::PutManyPairs, py::arg("pairs"), py::arg("readers"),
           py::arg("numpy_names"), py::arg("torch_type"), py::arg("strided"),
           py::arg("torch_names"), py::arg("slow"))
      .def("reserve", &PyProducer::Reserve, py::arg("key"), py::arg("nbytes"))
      .def("abort", &PyProducer::Abort)
      .def("reclaim", &PyProducer::Reclaim)
      .def("stats", &PyProducer::Stats)
      .def("segment_paths", &PyProducer::SegmentPaths)
      .def("segment_nodes", &PyProducer::SegmentNodes)
      .def("pending", &PyProducer::Pending)
      .def("instance_name", &PyProducer::InstanceName)
      .def("remote_address", &PyProducer::RemoteAddress)
      .def("close", &PyProducer::Close)
      .def_property_readonly("closed", &PyProducer::closed);

  py::class_<PyReservation>(m, "Reservation")
      .def("view", &PyReservation::View, py::arg("dtype"), py::arg("shape"))
      .def("publish", &PyReservation::Publish, py::arg("dtype"), py::arg("shape"),
           py::arg("readers"))
      .def("cancel", &PyReservation::Cancel)
      .def("address", &PyReservation::Address)
      .def_property_readonly("published", &PyReservation::published)
      .def_property_readonly("open", &PyReservation::open)
      .def_property_readonly("spilled", &PyReservation::spilled)
      .def_property_readonly("nbytes", &PyReservation::nbytes);

  py::class_<PyStreamTensor>(m, "StreamTensor")
      .def("buffer", &PyStreamTensor::Buffer, py::arg("writable") = false)
      .def("view", &PyStreamTensor::View, py::arg("writable"), py::arg("dtype"), py::arg("shape"))
      .def("release", &PyStreamTensor::Release)
      .def("address", &PyStreamTensor::Address)
      .def_property_readonly("released", &PyStreamTensor::released)
      .def("descriptor", [](const PyStreamTensor& t) { return DescriptorDict(t.descriptor()); })
      .def("summary", [](const PyStreamTensor& t) {
        const TensorDescriptor& d = t.descriptor();
        return py::make_tuple(d.key, d.dtype, Shape(d.shape), d.length);
      });

  py::class_<PyConsumer>(m, "StreamConsumer")
      .def(py::init<const std::string&, const std::string&, const std::string&, uint64_t, bool,
                    bool, const std::string&, double, bool>(),
           py::arg("directory"), py::arg("spill_directory"), py::arg("gpu"),
           py::arg("pin_budget_bytes"), py::arg("allow_foreign_owner"), py::arg("quiet"),
           py::arg("remote_token"), py::arg("remote_timeout_seconds"),
           py::arg("remote_allow_no_token") = false)
      .def("open", &PyConsumer::Open)
      .def("open_summary", &PyConsumer::OpenSummary)
      .def("open_many_summary", &PyConsumer::OpenManySummary)
      .def("open_many_arrays", &PyConsumer::OpenManyArrays, py::arg("descriptors"),
           py::arg("layouts"), py::arg("for_torch") = false)
      .def("poll_releases", &PyConsumer::PollReleases)
      .def("stats", &PyConsumer::Stats)
      .def("close", &PyConsumer::Close)
      .def_property_readonly("closed", &PyConsumer::closed);

  // The wire form of descriptor fields (a dict as decode_descriptor gives): how a pickled
  // StreamTensor travels.
  m.def("encode_descriptor", [](const py::dict& fields) {
    TensorDescriptor d;
    d.segment = fields["segment"].cast<std::string>();
    d.spilled = fields["spilled"].cast<bool>();
    d.slot = fields["slot"].cast<uint32_t>();
    d.generation = fields["generation"].cast<uint64_t>();
    d.offset = fields["offset"].cast<uint64_t>();
    d.length = fields["length"].cast<uint64_t>();
    d.dtype = fields["dtype"].cast<std::string>();
    d.shape = fields["shape"].cast<std::vector<uint64_t>>();
    d.key = fields["key"].cast<std::string>();
    if (fields.contains("remote")) {
      d.remote = fields["remote"].cast<std::string>();
      d.producer_instance = fields["producer_instance"].cast<uint64_t>();
      d.boot_id = fields["boot_id"].cast<std::string>();
    }
    return py::bytes(d.Encode());
  });
  m.def("decode_descriptor", [](const py::bytes& wire) {
    std::string bytes = wire;
    return DescriptorDict(Take(TensorDescriptor::Decode(bytes)));
  });
  m.def("sweep", [](const std::string& directory) {
    std::optional<Result<SweepReport>> report;
    {
      py::gil_scoped_release release;
      report.emplace(SweepStreamDirectory(directory));
    }
    SweepReport r = Take(std::move(*report));
    py::dict d;
    d["removed"] = r.removed;
    d["live"] = r.live;
    d["notes"] = r.notes;
    return d;
  });
  m.def("inspect_segment",
        [](const std::string& path) { return SegmentDict(Take(InspectSegment(path))); });
  m.def("metrics", [](const std::vector<std::string>& directories) {
    std::vector<std::string> problems;
    std::string text;
    {
      py::gil_scoped_release release;
      text = PrometheusText(directories, &problems);
    }
    return py::make_tuple(py::str(text), problems);
  });
}

}  // namespace expert_arena::python
