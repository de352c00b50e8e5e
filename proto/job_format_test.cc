#include "proto/job_format.h"

#include "google/protobuf/unknown_field_set.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace aqswarm::job_format {
namespace {

using v1::JobSpec;
using v1::LinkCompression;

// What an older build's bytes parse to: the string under its old number.
void StoreString(google::protobuf::Message* m, int number, const std::string& text) {
  m->GetReflection()->MutableUnknownFields(m)->AddLengthDelimited(number, text);
}

JobSpec RoundTrip(const JobSpec& job) {
  JobSpec back;
  EXPECT_TRUE(back.ParseFromString(job.SerializeAsString()));
  return back;
}

TEST(JobFormatTest, AnOlderBuildsStringsBecomeTheirEnums) {
  JobSpec old;
  old.set_name("old");
  StoreString(old.mutable_model(), 8, "llama");
  StoreString(old.mutable_optimizer(), 10, "dynamic");
  LinkCompression* c = old.mutable_compression();
  c->set_mode(LinkCompression::aqsgd);
  StoreString(c, 5, "int8");
  StoreString(c, 6, "memory");
  StoreString(c, 9, "fixed_point");
  StoreString(c, 12, "none");
  StoreString(c, 14, "tokens");
  StoreString(c, 15, "midtread");
  StoreString(c, 17, "tiled");
  StoreString(&old, 19, "1f1b");
  StoreString(&old, 22, "bf16");
  JobSpec job = RoundTrip(old);
  ASSERT_TRUE(UpgradeStoredJob(&job).ok());
  EXPECT_EQ(job.model().family(), v1::ModelSpec::Family::llama);
  EXPECT_EQ(job.optimizer().loss_scale(), v1::OptimizerSpec::LossScale::dynamic);
  EXPECT_EQ(job.compression().m_precision(), LinkCompression::MPrecision::int8);
  EXPECT_EQ(job.compression().store(), LinkCompression::Store::memory);
  EXPECT_EQ(job.compression().first_visit(), LinkCompression::FirstVisit::fixed_point);
  EXPECT_EQ(job.compression().rotation(), LinkCompression::Rotation::none);
  EXPECT_EQ(job.compression().tile_along(), LinkCompression::TileAlong::tokens);
  EXPECT_EQ(job.compression().tile_grid(), LinkCompression::TileGrid::midtread);
  EXPECT_EQ(job.compression().bw_codec(), LinkCompression::BwCodec::tiled);
  EXPECT_EQ(job.schedule(), JobSpec::Schedule::one_f_one_b);
  EXPECT_EQ(job.precision(), JobSpec::Precision::bf16);
  EXPECT_EQ(job.compression().mode(), LinkCompression::aqsgd);
  // Nothing of the old form is left to be written back.
  EXPECT_EQ(job.GetReflection()->GetUnknownFields(job).field_count(), 0);
  EXPECT_EQ(job.compression().GetReflection()->GetUnknownFields(job.compression()).field_count(), 0);
  JobSpec again = job;
  ASSERT_TRUE(UpgradeStoredJob(&again).ok());
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(again, job));
}

TEST(JobFormatTest, AnEmptyStoredStringIsUnspecified) {
  JobSpec old;
  StoreString(old.mutable_compression(), 9, "");
  StoreString(&old, 19, "");
  JobSpec job = RoundTrip(old);
  ASSERT_TRUE(UpgradeStoredJob(&job).ok());
  EXPECT_EQ(job.compression().first_visit(), LinkCompression::FirstVisit::UNSPECIFIED);
  EXPECT_EQ(job.schedule(), JobSpec::Schedule::UNSPECIFIED);
  EXPECT_EQ(job.GetReflection()->GetUnknownFields(job).field_count(), 0);
}

TEST(JobFormatTest, AStoredStringThatNamesNoValueIsDataLossNamingTheField) {
  JobSpec old;
  StoreString(old.mutable_model(), 8, "mamba");
  JobSpec job = RoundTrip(old);
  const absl::Status s = UpgradeStoredJob(&job);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("model.family 'mamba' is not gpt2 or llama"), std::string::npos) << s;
}

TEST(JobFormatTest, AJobOfThisBuildIsLeftAsItIs) {
  JobSpec job;
  job.set_schedule(JobSpec::Schedule::gpipe);
  job.mutable_compression()->set_store(LinkCompression::Store::rocksdb);
  JobSpec back = RoundTrip(job);
  ASSERT_TRUE(UpgradeStoredJob(&back).ok());
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(back, job));
}

TEST(JobFormatTest, EnumNamesAliasesAndChoices) {
  const auto* schedule = JobSpec::Schedule::Value_descriptor();
  ASSERT_NE(FindJobEnumValue(schedule, "1f1b"), nullptr);
  EXPECT_EQ(FindJobEnumValue(schedule, "1f1b")->number(), JobSpec::Schedule::one_f_one_b);
  EXPECT_EQ(FindJobEnumValue(schedule, "one_f_one_b")->number(), JobSpec::Schedule::one_f_one_b);
  EXPECT_EQ(FindJobEnumValue(schedule, "gpipe")->number(), JobSpec::Schedule::gpipe);
  EXPECT_EQ(FindJobEnumValue(schedule, "interleaved"), nullptr);
  EXPECT_EQ(JobEnumJsonName(FindJobEnumValue(schedule, "one_f_one_b")), "1f1b");
  EXPECT_EQ(JobEnumChoices(schedule), "adaptive, 1f1b or gpipe");
  EXPECT_EQ(JobEnumChoices(LinkCompression::Mode_descriptor()), "fp32, directq, aqsgd or tiled");
}

}  // namespace
}  // namespace aqswarm::job_format
