#include "common/log.h"

#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <memory>
#include <mutex>
#include <string>

namespace nbos {

namespace {

class FdSink final : public spdlog::sinks::base_sink<std::mutex> {
 public:
  explicit FdSink(int fd) : fd_(fd) {}

 protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    spdlog::memory_buf_t formatted;
    formatter_->format(msg, formatted);
    const char* p = formatted.data();
    size_t left = formatted.size();
    while (left > 0) {
      ssize_t n = ::write(fd_, p, left);
      if (n <= 0) return;  // nowhere to report a failing log fd
      p += n;
      left -= static_cast<size_t>(n);
    }
  }
  void flush_() override {}

 private:
  int fd_;
};

}  // namespace

void InitLogging(int fd, std::string_view level, std::string_view name) {
  auto logger = std::make_shared<spdlog::logger>(std::string(name), std::make_shared<FdSink>(fd));
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%n] [%^%l%$] %v");
  auto lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") lvl = spdlog::level::info;
  logger->set_level(lvl);
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(std::move(logger));
}

}  // namespace nbos
