// TensorBoard event files: CRC32C against published check values, and a
// written file read back by the independent reader in support/tfevents.
#include <filesystem>
#include <fstream>

#include <unistd.h>

#include "ddp/io/tensorboard.h"
#include "support/testing.h"
#include "support/tfevents.h"

namespace {

TEST(TensorBoard, Crc32cMatchesPublishedCheckValues) {
  // The CRC catalogue's check value, and RFC 3720 (iSCSI) appendix B.4.
  EXPECT_EQ(ddp::crc32c("123456789", 9), 0xe3069283u);
  std::string zeros(32, '\0'), ones(32, '\xff'), ascending(32, '\0');
  for (int i = 0; i < 32; ++i) ascending[static_cast<size_t>(i)] = static_cast<char>(i);
  EXPECT_EQ(ddp::crc32c(zeros.data(), zeros.size()), 0x8a9136aau);
  EXPECT_EQ(ddp::crc32c(ones.data(), ones.size()), 0x62a8ab43u);
  EXPECT_EQ(ddp::crc32c(ascending.data(), ascending.size()), 0x46dd794eu);
  // Masking is a rotation plus a constant, so it is reversible.
  const uint32_t masked = ddp::masked_crc32c("123456789", 9), rotated = masked - 0xa282ead8u;
  EXPECT_EQ((rotated << 15) | (rotated >> 17), 0xe3069283u);
}

TEST(TensorBoard, WrittenFileParsesBackWithValidCrcs) {
  const auto dir = ddp::testing::temp_dir("tb");
  const double t0 = 1700000000.25;
  std::string path;
  {
    ddp::EventWriter w(dir, t0);
    path = w.path();
    for (int i = 0; i < 10; ++i) w.add_scalar("train/loss", 2.0 / (i + 1), 10 * i, t0 + i);
    w.add_scalar("test/accuracy", 0.8765, 1234567890123LL, t0 + 20);  // a step that needs 6 varint bytes
  }
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  EXPECT_EQ(std::filesystem::path(path).filename().string(), std::string("events.out.tfevents.1700000000.") + host);
  EXPECT_EQ(ddp::testing::event_files(dir), std::vector<std::string>{path});

  const auto f = ddp::testing::read_event_file(path);
  EXPECT_EQ(f.first_file_version, "brain.Event:2");
  EXPECT_EQ(f.records, 12u);
  ASSERT_EQ(f.scalars.size(), 11u);
  for (int i = 0; i < 10; ++i) {
    const auto& s = f.scalars[static_cast<size_t>(i)];
    EXPECT_EQ(s.tag, "train/loss");
    EXPECT_EQ(s.step, 10 * i);
    EXPECT_EQ(s.value, static_cast<float>(2.0 / (i + 1)));
    EXPECT_DOUBLE_EQ(s.wall_time, t0 + i);
  }
  EXPECT_EQ(f.scalars[10].tag, "test/accuracy");
  EXPECT_EQ(f.scalars[10].step, 1234567890123LL);
  EXPECT_EQ(f.scalars[10].value, 0.8765f);
}

// The reader's CRC checks are live: a flipped bit in the data or in the
// length is found.
TEST(TensorBoard, CorruptedRecordFailsItsCrc) {
  const auto dir = ddp::testing::temp_dir("tb_bad");
  std::string path;
  {
    ddp::EventWriter w(dir, 1700000000);
    path = w.path();
    w.add_scalar("test/loss", 0.5, 7, 1700000001);
  }
  const std::string good = ddp::testing::read_file(path);
  const size_t first_record = 8 + 4 + ddp::file_version_event(1700000000).size() + 4;
  for (size_t offset : {first_record + 20, first_record + 2}) {
    std::string bad = good;
    bad[offset] = static_cast<char>(bad[offset] ^ 0x04);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bad;
    EXPECT_THROW(ddp::testing::read_event_file(path), std::runtime_error) << "flipped byte " << offset;
  }
}

}  // namespace
