// Prometheus' text exposition format (version 0.0.4): families of samples, each family written
// as one group, in the order declared.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace expert_arena::metrics {

using Labels = std::vector<std::pair<std::string, std::string>>;

class Exposition {
 public:
  // `type` is "gauge" or "counter" (a counter's name ends in _total).
  void Declare(const std::string& name, const std::string& type, const std::string& help);
  // A sample of a declared family.
  void Add(const std::string& name, const Labels& labels, uint64_t value);
  void AddReal(const std::string& name, const Labels& labels, double value);
  std::string Text() const;

 private:
  struct Family {
    std::string name, type, help;
    std::vector<std::string> samples;
  };
  void AddLine(const std::string& name, const Labels& labels, const std::string& value);

  std::vector<Family> families_;
  std::map<std::string, size_t> index_;
};

// A label value as the format takes it: printable ASCII as it is (\, " escaped), anything else
// as `ls` writes it (\xNN), so the value is valid UTF-8 and names the same file as `ls` does.
std::string LabelValue(const std::string& raw);

}  // namespace expert_arena::metrics
