#include "source_test_util.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>

namespace expert_arena::testing {

ScopedDir::ScopedDir(const std::string& tag) {
  static int counter = 0;
  path_ = "/tmp/ea-test-" + std::to_string(getpid()) + "-" + std::to_string(counter++) + "-" + tag;
  std::filesystem::create_directories(path_);
}

ScopedDir::~ScopedDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::vector<std::byte> ReadFileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(raw.size());
  std::memcpy(out.data(), raw.data(), raw.size());
  return out;
}

void WriteFileBytes(const std::string& path, const std::vector<std::byte>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

std::vector<std::byte> ReadRange(const std::string& path, uint64_t offset, uint64_t bytes) {
  std::ifstream in(path, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(offset));
  std::vector<std::byte> out(bytes);
  in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(bytes));
  if (static_cast<uint64_t>(in.gcount()) != bytes) throw std::runtime_error("short read " + path);
  return out;
}

std::map<std::string, IndependentTensor> ParseGgufIndependently(const std::string& path) {
  std::vector<std::byte> f = ReadFileBytes(path);
  size_t o = 0;
  auto u32 = [&] {
    uint32_t v;
    std::memcpy(&v, &f.at(o), 4);
    o += 4;
    return v;
  };
  auto u64 = [&] {
    uint64_t v;
    std::memcpy(&v, &f.at(o), 8);
    o += 8;
    return v;
  };
  auto str = [&] {
    uint64_t n = u64();
    std::string s(reinterpret_cast<const char*>(&f.at(o)), n);
    o += n;
    return s;
  };
  // Sizes of the value types the gen-model and test files use.
  auto skip_value = [&](auto&& self, uint32_t type) -> void {
    static const size_t kSizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    if (type == 8) {
      str();
    } else if (type == 9) {
      uint32_t et = u32();
      uint64_t n = u64();
      for (uint64_t k = 0; k < n; ++k) self(self, et);
    } else {
      o += kSizes[type];
    }
  };
  o = 4;
  u32();
  uint64_t tensors = u64(), kvs = u64();
  uint64_t alignment = 32;
  for (uint64_t k = 0; k < kvs; ++k) {
    std::string key = str();
    uint32_t type = u32();
    if (key == "general.alignment") {
      alignment = u32();
    } else {
      skip_value(skip_value, type);
    }
  }
  struct Info {
    std::string name;
    std::vector<uint64_t> ne;
    uint32_t type;
    uint64_t offset;
  };
  std::vector<Info> infos;
  for (uint64_t t = 0; t < tensors; ++t) {
    Info info;
    info.name = str();
    uint32_t n = u32();
    for (uint32_t d = 0; d < n; ++d) info.ne.push_back(u64());
    info.type = u32();
    info.offset = u64();
    infos.push_back(info);
  }
  uint64_t data = (o + alignment - 1) / alignment * alignment;
  std::map<std::string, IndependentTensor> out;
  for (const Info& info : infos) {
    uint64_t elems = 1;
    for (uint64_t d : info.ne) elems *= d;
    uint64_t bytes = 0;
    switch (info.type) {
      case 0:
        bytes = elems * 4;
        break;  // f32
      case 1:
      case 30:
        bytes = elems * 2;
        break;  // f16, bf16
      case 8:
        bytes = elems / 32 * 34;
        break;  // q8_0
      case 24:
        bytes = elems;
        break;  // i8
      default:
        throw std::runtime_error("type not in the test parser");
    }
    out[info.name] = {data + info.offset, bytes, std::to_string(info.type)};
  }
  return out;
}

std::map<std::string, IndependentTensor> ParseSafetensorsIndependently(const std::string& path) {
  std::vector<std::byte> head = ReadRange(path, 0, 8);
  uint64_t n;
  std::memcpy(&n, head.data(), 8);
  std::vector<std::byte> text = ReadRange(path, 8, n);
  auto json = nlohmann::json::parse(reinterpret_cast<const char*>(text.data()),
                                    reinterpret_cast<const char*>(text.data()) + n);
  std::map<std::string, IndependentTensor> out;
  for (auto it = json.begin(); it != json.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    uint64_t begin = (*it)["data_offsets"][0], end = (*it)["data_offsets"][1];
    out[it.key()] = {8 + n + begin, end - begin, (*it)["dtype"]};
  }
  return out;
}

}  // namespace expert_arena::testing
