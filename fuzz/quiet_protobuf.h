// Included by the fuzz targets that parse protobuf messages: libprotobuf
// logs every invalid UTF-8 string field it parses to stderr, which slows a
// fuzzer to a crawl and buries its report. Defines LLVMFuzzerInitialize.
#ifndef AQSWARM_FUZZ_QUIET_PROTOBUF_H_
#define AQSWARM_FUZZ_QUIET_PROTOBUF_H_

#include "google/protobuf/stubs/logging.h"

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  google::protobuf::SetLogHandler(nullptr);  // nullptr: discard
  return 0;
}

#endif  // AQSWARM_FUZZ_QUIET_PROTOBUF_H_
