// Uses the installed headers and libraries: prints the build and runs a CPU-device copy.
#include <cstdio>
#include <cstring>
#include <vector>

#include "engine/core/device.h"
#include "engine/version.h"
#include "offload/tier.h"

int main() {
  std::printf("%s\n", strata::build_description().c_str());
  auto device = strata::create_cpu_device({.budget_bytes = 1 << 20});
  if (!device.ok()) {
    std::fprintf(stderr, "%s\n", device.status().to_string().c_str());
    return 1;
  }
  auto stream = (*device)->create_stream("consumer");
  auto buffer = (*device)->allocate(4096, "consumer buffer");
  if (!stream.ok() || !buffer.ok()) return 1;
  std::vector<char> in(4096, 'x'), out(4096, 0);
  if (!(*device)->copy_async(buffer->data(), in.data(), in.size(), strata::CopyKind::kHostToDevice, **stream).ok()) return 1;
  if (!(*device)->copy_async(out.data(), buffer->data(), out.size(), strata::CopyKind::kDeviceToHost, **stream).ok()) return 1;
  if (!(*stream)->synchronize().ok() || std::memcmp(in.data(), out.data(), in.size()) != 0) return 1;
  std::printf("consumer: ok (%s)\n", std::string(strata::tier_name(strata::Tier::kNvme)).c_str());
  return 0;
}
