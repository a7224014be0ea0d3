// FP8 targets on the host backend (docs/protocol.md, "FP8 targets"): the
// elements of each quantised use (CopyPlan::quant) arrive chunk by chunk
// in stream order, which is the order of their places in the parameter.
// They are widened to float32 into a band, one row of blocks of the
// rectangle the use writes; once a band holds every element it is
// quantised (common/fp8.h) and written: FP8 elements into the parameter,
// one scale per block into the scale parameter. So a block is written
// once, whole, with its own scale; a chunk that ends inside a band leaves
// it waiting for the next chunk. At most one band per use is open; a
// band's memory is released after the use's last band. A gathered use
// (QuantTarget::gathered: the links of a transfer plan feed it, in no
// fixed order) keeps each of its bands open until every element of it
// has arrived; the plan bounds how many bytes that holds
// (CopyPlan::quant_band_bytes).
//
// Thread-compatible: the host data plane's owner thread alone uses it,
// one instance per update (Reset at Begin).
#ifndef WEIGHTSYNC_BACKENDS_HOST_QUANT_SCATTER_H_
#define WEIGHTSYNC_BACKENDS_HOST_QUANT_SCATTER_H_

#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "daemon/core/copy_plan.h"
#include "daemon/core/source_registry.h"

namespace weightsync {

class QuantScatter {
 public:
  // Forgets every open band; sized for `plan`'s quantised uses.
  void Reset(const CopyPlan& plan);

  // Takes the quantised pieces of chunk `index`: their bytes are in
  // `chunk`, or, where `source` is set, in the registered source's memory.
  // Engines flagged in `lost` (may be null) are skipped. DATA_LOSS naming
  // the source if its memory shrank under the daemon; INTERNAL if pieces
  // of a use arrive out of order (a broken plan).
  absl::Status Feed(const CopyPlan& plan, int64_t index, const uint8_t* chunk,
                    const Source* source, const std::atomic<bool>* lost);

  // Float32 bytes of the bands open now (at most the plan's
  // quant_band_bytes).
  int64_t open_bytes() const;

 private:
  struct Band {
    int64_t index = -1;  // row of blocks being filled, -1: none
    int64_t filled = 0;  // elements received
    std::vector<float> values;
  };

  // Widens `n` source elements at `src` into the band of `target` at
  // parameter element `dest` onward, quantising every band they complete.
  absl::Status Take(const CopyPlan& plan, int32_t target, const uint8_t* src,
                    int64_t dest, int64_t n);
  // Quantises and writes full band `b` of `target`.
  void Flush(const CopyPlan& plan, int32_t target, Band& b);

  std::vector<Band> bands_;
  // Gathered uses' open bands, by row of blocks.
  std::vector<absl::flat_hash_map<int64_t, Band>> gathered_;
};

}  // namespace weightsync

#endif  // WEIGHTSYNC_BACKENDS_HOST_QUANT_SCATTER_H_
