// Progress output: a bar on a terminal, plain lines elsewhere.
#include <cstdio>

#include "ddp/io/progress.h"
#include "support/testing.h"

namespace {

std::string render(ddp::ProgressMode mode) {
  std::FILE* f = std::tmpfile();
  ddp::Progress p(mode, 2, 5, 100, f);
  p.update(50, 0.4321, 1e-3, 1234.0);
  p.update(100, 0.3, 1e-3, 1300.0);
  p.close();
  std::rewind(f);
  std::string out;
  char buf[512];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  std::fclose(f);
  return out;
}

TEST(Progress, PlainLinesCarryEveryField) {
  auto out = render(ddp::ProgressMode::kPlain);
  EXPECT_EQ(out.find('\r'), std::string::npos);
  EXPECT_NE(out.find("epoch 2/5 step 50/100 loss 0.4321 lr 0.001 1234 samples/s eta "), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 2);
}

TEST(Progress, BarRedrawsInPlace) {
  auto out = render(ddp::ProgressMode::kBar);
  EXPECT_EQ(std::count(out.begin(), out.end(), '\r'), 2);
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1);
  EXPECT_NE(out.find("[############............] 50/100"), std::string::npos) << out;
  EXPECT_NE(out.find("ETA"), std::string::npos);
}

TEST(Progress, NoneIsSilentAndDurationsFormat) {
  EXPECT_EQ(render(ddp::ProgressMode::kNone), "");
  EXPECT_EQ(ddp::format_duration(65), "1:05");
  EXPECT_EQ(ddp::format_duration(3723), "1:02:03");
}

}  // namespace
