// Builders of RegisterEngineRequest pieces shared by the FP8 tests of the
// host and GPU data planes (quant_scatter_test, quant_steps_test).
#ifndef WEIGHTSYNC_TESTS_TESTING_LAYOUT_BUILDERS_H_
#define WEIGHTSYNC_TESTS_TESTING_LAYOUT_BUILDERS_H_

#include <cstdint>
#include <string>

#include "weightsync/v1/engine_service.pb.h"

namespace weightsync {
namespace testing {

// Makes `p` an FP8 target of `format` whose scales are parameter `scale`;
// block_rows / block_cols 0 mean the default (128).
inline void Quantize(v1::Parameter* p, v1::DType format,
                     const std::string& scale, v1::QuantScheme scheme,
                     v1::ScaleForm form, int64_t block_rows = 0,
                     int64_t block_cols = 0) {
  v1::Quantization* q = p->mutable_quantization();
  q->set_format(format);
  q->set_scale_parameter(scale);
  q->set_scheme(scheme);
  q->set_scale_form(form);
  q->set_block_rows(block_rows);
  q->set_block_cols(block_cols);
}

// Adds the segment of `source` rows [rb, rb + rc), cols [cb, cb + cc)
// written at element `dest` with `stride` elements per row.
inline void AddSegment(v1::Parameter* p, const std::string& source, int64_t rb,
                       int64_t rc, int64_t cb, int64_t cc, int64_t dest,
                       int64_t stride) {
  v1::Segment* s = p->add_segments();
  s->set_source(source);
  s->set_row_begin(rb);
  s->set_row_count(rc);
  s->set_col_begin(cb);
  s->set_col_count(cc);
  s->set_dest_offset(dest);
  s->set_dest_row_stride(stride);
}

}  // namespace testing
}  // namespace weightsync

#endif  // WEIGHTSYNC_TESTS_TESTING_LAYOUT_BUILDERS_H_
