#include "expert_table.h"

#include <map>
#include <optional>
#include <regex>
#include <tuple>

namespace expert_arena::moe {
namespace {

enum Kind { kGate = 0, kUp = 1, kDown = 2 };
const char* const kKindNames[] = {"gate", "up", "down"};

Kind KindFromName(const std::string& s) { return s == "gate" ? kGate : s == "up" ? kUp : kDown; }

std::string ShapeText(std::span<const uint64_t> shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

std::optional<uint64_t> Mul(uint64_t a, uint64_t b) {
  uint64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

// Builds the Matrix for `rows` x `cols` values starting `first_row` rows into `view`, after
// checking that `view` holds exactly `total_rows` such rows.
Result<Matrix> MatrixIn(const TensorView& view, uint64_t total_rows, uint64_t first_row,
                        uint64_t rows, uint64_t cols) {
  std::string name(view.name);
  auto dtype = ParseDtype(view.dtype);
  if (!dtype) {
    return InvalidArgument("tensor " + name + ": dtype " + std::string(view.dtype) +
                           " is not one moe-engine computes with (f32, f16, bf16, q8_0)");
  }
  auto row_bytes = RowBytes(*dtype, cols);
  if (!row_bytes) {
    return InvalidArgument("tensor " + name + ": rows of " + std::to_string(cols) +
                           " values cannot be stored as " + DtypeName(*dtype));
  }
  auto expected = Mul(*row_bytes, total_rows);
  if (!expected || *expected != view.bytes.size()) {
    return Corrupt("tensor " + name + ": " + std::to_string(view.bytes.size()) +
                   " bytes, but shape " + ShapeText(view.shape) + " of " + DtypeName(*dtype) +
                   " needs " + (expected ? std::to_string(*expected) : "more than 2^64"));
  }
  Matrix m;
  m.data = view.bytes.data() + first_row * *row_bytes;
  m.dtype = *dtype;
  m.rows = rows;
  m.cols = cols;
  m.row_bytes = *row_bytes;
  return m;
}

Status ExpectShape(const TensorView& view, std::initializer_list<uint64_t> expected) {
  std::vector<uint64_t> want(expected);
  if (!std::equal(view.shape.begin(), view.shape.end(), want.begin(), want.end())) {
    return Corrupt("tensor " + std::string(view.name) + ": shape " + ShapeText(view.shape) +
                   ", expected " + ShapeText(want));
  }
  return Status::Ok();
}

}  // namespace

Result<ExpertTable> ExpertTable::Build(std::span<const TensorView> views) {
  static const std::regex kGguf(R"(^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$)");
  static const std::regex kSafetensors(
      R"(^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$)");
  // (layer, expert, kind) -> view; expert is 0 for GGUF, whose tensors hold every expert.
  std::map<std::tuple<uint64_t, uint64_t, int>, const TensorView*> gguf, safetensors;
  uint64_t max_layer = 0, max_expert = 0;
  for (const TensorView& view : views) {
    std::string name(view.name);
    std::smatch m;
    if (std::regex_match(name, m, kGguf)) {
      uint64_t layer = std::stoull(m[1].str());
      gguf[{layer, 0, KindFromName(m[2].str())}] = &view;
      max_layer = std::max(max_layer, layer);
    } else if (std::regex_match(name, m, kSafetensors)) {
      uint64_t layer = std::stoull(m[1].str());
      uint64_t expert = std::stoull(m[2].str());
      safetensors[{layer, expert, KindFromName(m[3].str())}] = &view;
      max_layer = std::max(max_layer, layer);
      max_expert = std::max(max_expert, expert);
    }
  }
  if (gguf.empty() && safetensors.empty()) {
    std::string seen = views.empty() ? "no tensors"
                                     : std::to_string(views.size()) + " tensors, the first " +
                                           std::string(views[0].name);
    return NotFound(
        "no routed-expert tensors (blk.N.ffn_{gate,up,down}_exps.weight or "
        "model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight) among " +
        seen);
  }
  if (!gguf.empty() && !safetensors.empty()) {
    return InvalidArgument("expert tensors of both GGUF and safetensors naming in one arena");
  }
  // Layer counts come from names, which a damaged table could make absurd.
  if (max_layer >= (1u << 20) || max_expert >= (1u << 20)) {
    return Corrupt("expert tensor names give layer " + std::to_string(max_layer) + " and expert " +
                   std::to_string(max_expert) + ": too many to be a model");
  }

  ExpertTable table;
  table.layers_ = max_layer + 1;
  std::string first_dtype;
  bool mixed = false;
  auto note_dtype = [&](const TensorView& v) {
    std::string d = DtypeName(*ParseDtype(v.dtype));
    if (first_dtype.empty()) first_dtype = d;
    if (d != first_dtype) mixed = true;
  };

  if (!gguf.empty()) {
    table.naming_ = "gguf";
    auto find = [&](uint64_t layer, int kind) -> Result<const TensorView*> {
      auto it = gguf.find({layer, 0, kind});
      if (it == gguf.end()) {
        return NotFound("expert tensor blk." + std::to_string(layer) + ".ffn_" + kKindNames[kind] +
                        "_exps.weight is missing (the model has " + std::to_string(table.layers_) +
                        " layers)");
      }
      return it->second;
    };
    EA_ASSIGN_OR_RETURN(const TensorView* first, find(0, kGate));
    if (first->shape.size() != 3) {
      return Corrupt("tensor " + std::string(first->name) + ": shape " + ShapeText(first->shape) +
                     ", expected ggml ne=[hidden, ffn, experts]");
    }
    table.hidden_ = first->shape[0];
    table.ffn_ = first->shape[1];
    table.experts_ = first->shape[2];
    const uint64_t h = table.hidden_, f = table.ffn_, e = table.experts_;
    if (h == 0 || f == 0 || e == 0) {
      return Corrupt("tensor " + std::string(first->name) + ": empty shape " +
                     ShapeText(first->shape));
    }
    if (!Mul(f, e) || !Mul(h, e) || !Mul(table.layers_, e)) {
      return Corrupt("tensor " + std::string(first->name) + ": shape " + ShapeText(first->shape) +
                     " overflows");
    }
    table.weights_.resize(table.layers_ * e);
    for (uint64_t l = 0; l < table.layers_; ++l) {
      EA_ASSIGN_OR_RETURN(const TensorView* gate, find(l, kGate));
      EA_ASSIGN_OR_RETURN(const TensorView* up, find(l, kUp));
      EA_ASSIGN_OR_RETURN(const TensorView* down, find(l, kDown));
      EA_RETURN_IF_ERROR(ExpectShape(*gate, {h, f, e}));
      EA_RETURN_IF_ERROR(ExpectShape(*up, {h, f, e}));
      EA_RETURN_IF_ERROR(ExpectShape(*down, {f, h, e}));
      for (uint64_t x = 0; x < e; ++x) {
        ExpertWeights& w = table.weights_[l * e + x];
        EA_ASSIGN_OR_RETURN(w.gate, MatrixIn(*gate, f * e, x * f, f, h));
        EA_ASSIGN_OR_RETURN(w.up, MatrixIn(*up, f * e, x * f, f, h));
        EA_ASSIGN_OR_RETURN(w.down, MatrixIn(*down, h * e, x * h, h, f));
      }
      note_dtype(*gate);
      note_dtype(*up);
      note_dtype(*down);
    }
  } else {
    table.naming_ = "safetensors";
    table.experts_ = max_expert + 1;
    auto find = [&](uint64_t layer, uint64_t expert, int kind) -> Result<const TensorView*> {
      auto it = safetensors.find({layer, expert, kind});
      if (it == safetensors.end()) {
        return NotFound("expert tensor model.layers." + std::to_string(layer) + ".mlp.experts." +
                        std::to_string(expert) + "." + kKindNames[kind] +
                        "_proj.weight is missing (the model has " + std::to_string(table.layers_) +
                        " layers of " + std::to_string(table.experts_) + " experts)");
      }
      return it->second;
    };
    EA_ASSIGN_OR_RETURN(const TensorView* first, find(0, 0, kGate));
    if (first->shape.size() != 2 || first->shape[0] == 0 || first->shape[1] == 0) {
      return Corrupt("tensor " + std::string(first->name) + ": shape " + ShapeText(first->shape) +
                     ", expected [ffn, hidden]");
    }
    table.ffn_ = first->shape[0];
    table.hidden_ = first->shape[1];
    const uint64_t h = table.hidden_, f = table.ffn_, e = table.experts_;
    table.weights_.resize(table.layers_ * e);
    for (uint64_t l = 0; l < table.layers_; ++l) {
      for (uint64_t x = 0; x < e; ++x) {
        EA_ASSIGN_OR_RETURN(const TensorView* gate, find(l, x, kGate));
        EA_ASSIGN_OR_RETURN(const TensorView* up, find(l, x, kUp));
        EA_ASSIGN_OR_RETURN(const TensorView* down, find(l, x, kDown));
        EA_RETURN_IF_ERROR(ExpectShape(*gate, {f, h}));
        EA_RETURN_IF_ERROR(ExpectShape(*up, {f, h}));
        EA_RETURN_IF_ERROR(ExpectShape(*down, {h, f}));
        ExpertWeights& w = table.weights_[l * e + x];
        EA_ASSIGN_OR_RETURN(w.gate, MatrixIn(*gate, f, 0, f, h));
        EA_ASSIGN_OR_RETURN(w.up, MatrixIn(*up, f, 0, f, h));
        EA_ASSIGN_OR_RETURN(w.down, MatrixIn(*down, h, 0, h, f));
        note_dtype(*gate);
        note_dtype(*up);
        note_dtype(*down);
      }
    }
  }
  table.dtype_name_ = mixed ? "mixed" : first_dtype;
  return table;
}

uint64_t ExpertTable::ExpertBytes(uint64_t layer, uint64_t expert) const {
  const ExpertWeights& w = at(layer, expert);
  return MatrixBytes(w.gate).size() + MatrixBytes(w.up).size() + MatrixBytes(w.down).size();
}

uint64_t ExpertTable::TotalBytes() const {
  uint64_t total = 0;
  for (uint64_t l = 0; l < layers_; ++l) {
    for (uint64_t e = 0; e < experts_; ++e) total += ExpertBytes(l, e);
  }
  return total;
}

}  // namespace expert_arena::moe
