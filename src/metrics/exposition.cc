#include "metrics/exposition.h"

#include <cstdio>

#include "common/escape.h"

namespace expert_arena::metrics {

void Exposition::Declare(const std::string& name, const std::string& type,
                         const std::string& help) {
  if (index_.count(name) != 0) return;
  index_[name] = families_.size();
  families_.push_back({name, type, help, {}});
}

void Exposition::Add(const std::string& name, const Labels& labels, uint64_t value) {
  AddLine(name, labels, std::to_string(value));
}

void Exposition::AddReal(const std::string& name, const Labels& labels, double value) {
  char text[64];
  std::snprintf(text, sizeof text, "%.17g", value);
  AddLine(name, labels, text);
}

void Exposition::AddLine(const std::string& name, const Labels& labels,
                         const std::string& value) {
  std::string line = name;
  if (!labels.empty()) {
    line += '{';
    for (size_t i = 0; i < labels.size(); ++i) {
      if (i > 0) line += ',';
      line += labels[i].first + "=\"" + LabelValue(labels[i].second) + '"';
    }
    line += '}';
  }
  families_[index_.at(name)].samples.push_back(line + ' ' + value);
}

std::string Exposition::Text() const {
  std::string out;
  for (const auto& f : families_) {
    if (f.samples.empty()) continue;
    out += "# HELP " + f.name + ' ' + f.help + '\n';
    out += "# TYPE " + f.name + ' ' + f.type + '\n';
    for (const auto& s : f.samples) out += s + '\n';
  }
  return out;
}

std::string LabelValue(const std::string& raw) {
  bool plain = true;
  for (unsigned char c : raw) plain = plain && c >= 0x20 && c < 0x7f;
  const std::string text = plain ? raw : EscapeForMessage(raw);
  std::string out;
  for (char c : text) {
    if (c == '\\' || c == '"') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace expert_arena::metrics
