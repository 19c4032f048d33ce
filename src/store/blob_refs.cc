#include "store/blob_refs.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "store/blob_store.h"

namespace nbos::store {

namespace {

constexpr std::string_view kMagic = "NBSD";
constexpr unsigned char kVersion = 1;
constexpr size_t kFixedBytes = 10;  // magic, version, kind, header length

void AddIfKey(const nlohmann::json& value, std::vector<std::string>* keys) {
  if (!value.is_string()) return;
  const std::string& key = value.get_ref<const std::string&>();
  if (IsValidBlobKey(key) && std::find(keys->begin(), keys->end(), key) == keys->end()) {
    keys->push_back(key);
  }
}

}  // namespace

std::vector<std::string> BlobKeysOfContainer(std::string_view bytes) {
  std::vector<std::string> keys;
  if (bytes.size() < kFixedBytes || bytes.substr(0, kMagic.size()) != kMagic ||
      static_cast<unsigned char>(bytes[4]) != kVersion || (bytes[5] != 'D' && bytes[5] != 'S')) {
    return keys;
  }
  uint32_t header_bytes = 0;
  for (int i = 0; i < 4; ++i) {
    header_bytes |= static_cast<uint32_t>(static_cast<unsigned char>(bytes[6 + i])) << (8 * i);
  }
  if (header_bytes > bytes.size() - kFixedBytes) return keys;
  const auto header = nlohmann::json::parse(bytes.substr(kFixedBytes, header_bytes), nullptr,
                                            /*allow_exceptions=*/false);
  if (!header.is_object()) return keys;
  if (auto it = header.find("payload"); it != header.end()) AddIfKey(*it, &keys);
  if (auto it = header.find("blobs"); it != header.end() && it->is_array()) {
    for (const auto& pair : *it) {
      if (pair.is_array() && pair.size() == 2) AddIfKey(pair[1], &keys);
    }
  }
  if (auto it = header.find("oob"); it != header.end() && it->is_array()) {
    for (const auto& key : *it) AddIfKey(key, &keys);
  }
  return keys;
}

void AddBlobKeysIn(std::string_view bytes, std::set<std::string>* keys) {
  for (size_t at = bytes.find(kMagic); at != std::string_view::npos;
       at = bytes.find(kMagic, at + 1)) {
    for (std::string& key : BlobKeysOfContainer(bytes.substr(at))) keys->insert(std::move(key));
  }
}

}  // namespace nbos::store
