#include "proto/job_format.h"

#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/unknown_field_set.h"

namespace aqswarm::job_format {

using google::protobuf::Descriptor;
using google::protobuf::EnumDescriptor;
using google::protobuf::EnumValueDescriptor;
using google::protobuf::Message;

const EnumValueDescriptor* FindJobEnumValue(const EnumDescriptor* e, absl::string_view name) {
  for (int i = 0; i < e->value_count(); ++i) {
    const EnumValueDescriptor* v = e->value(i);
    if (v->name() == name || JobEnumJsonName(v) == name) return v;
  }
  return nullptr;
}

const std::string& JobEnumJsonName(const EnumValueDescriptor* v) {
  return v->options().HasExtension(v1::json_alias) ? v->options().GetExtension(v1::json_alias) : v->name();
}

std::string JobEnumChoices(const EnumDescriptor* e) {
  std::vector<std::string> names;
  for (int i = 0; i < e->value_count(); ++i) {
    const EnumValueDescriptor* v = e->value(i);
    if (v->number() == 0 && absl::EndsWith(v->name(), "UNSPECIFIED")) continue;
    names.push_back(JobEnumJsonName(v));
  }
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    absl::StrAppend(&out, i == 0 ? "" : i + 1 == names.size() ? " or " : ", ", names[i]);
  }
  return out;
}

namespace {

// A string field of an older build: its message, its old number, the enum
// field it became.
struct StoredString {
  const Descriptor* message;
  int old_number;
  const char* field;
};

absl::Status Upgrade(Message* m, const std::string& path, const std::vector<StoredString>& fields) {
  const Descriptor* d = m->GetDescriptor();
  const google::protobuf::Reflection* r = m->GetReflection();
  google::protobuf::UnknownFieldSet* unknown = r->MutableUnknownFields(m);
  for (const StoredString& s : fields) {
    if (s.message != d) continue;
    const google::protobuf::FieldDescriptor* f = d->FindFieldByName(s.field);
    for (int i = 0; i < unknown->field_count(); ++i) {
      const google::protobuf::UnknownField& u = unknown->field(i);
      if (u.number() != s.old_number || u.type() != google::protobuf::UnknownField::TYPE_LENGTH_DELIMITED) continue;
      const std::string& text = u.length_delimited();
      const EnumValueDescriptor* v = text.empty() ? f->enum_type()->FindValueByNumber(0)
                                                  : FindJobEnumValue(f->enum_type(), text);
      if (v == nullptr) {
        return absl::DataLossError(absl::StrCat("stored job: ", path, f->name(), " '", text, "' is not ",
                                                JobEnumChoices(f->enum_type())));
      }
      if (r->GetEnumValue(*m, f) == 0) r->SetEnumValue(m, f, v->number());
    }
    unknown->DeleteByNumber(s.old_number);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status UpgradeStoredJob(v1::JobSpec* job) {
  const std::vector<StoredString> fields = {
      {v1::ModelSpec::descriptor(), 8, "family"},
      {v1::OptimizerSpec::descriptor(), 10, "loss_scale"},
      {v1::LinkCompression::descriptor(), 5, "m_precision"},
      {v1::LinkCompression::descriptor(), 6, "store"},
      {v1::LinkCompression::descriptor(), 9, "first_visit"},
      {v1::LinkCompression::descriptor(), 12, "rotation"},
      {v1::LinkCompression::descriptor(), 14, "tile_along"},
      {v1::LinkCompression::descriptor(), 15, "tile_grid"},
      {v1::LinkCompression::descriptor(), 17, "bw_codec"},
      {v1::JobSpec::descriptor(), 19, "schedule"},
      {v1::JobSpec::descriptor(), 22, "precision"},
  };
  if (job->has_model()) {
    if (absl::Status s = Upgrade(job->mutable_model(), "model.", fields); !s.ok()) return s;
  }
  if (job->has_optimizer()) {
    if (absl::Status s = Upgrade(job->mutable_optimizer(), "optimizer.", fields); !s.ok()) return s;
  }
  if (job->has_compression()) {
    if (absl::Status s = Upgrade(job->mutable_compression(), "compression.", fields); !s.ok()) return s;
  }
  return Upgrade(job, "", fields);
}

}  // namespace aqswarm::job_format
