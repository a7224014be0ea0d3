#include "backends/cuda/fused_receipts.h"

#include <algorithm>

namespace weightsync {
namespace cuda {
namespace {

// Resolved receipt regions with elements, by address: which one holds a
// byte.
class RegionIndex {
 public:
  explicit RegionIndex(const std::vector<ReceiptRegion>& regions)
      : regions_(regions) {
    for (size_t i = 0; i < regions.size(); ++i) {
      if (regions[i].rows > 0 && regions[i].cols > 0) {
        order_.push_back(i);
        elements_ += regions[i].rows * regions[i].cols;
      }
    }
    std::sort(order_.begin(), order_.end(), [&](int a, int b) {
      return regions_[a].base < regions_[b].base;
    });
  }

  // Elements of all the regions.
  int64_t elements() const { return elements_; }

  // The region whose elements hold `p` (a row, not a gap between rows): its
  // index, the row and the column; -1 if none.
  int Find(const uint8_t* p, int64_t* row, int64_t* col) const {
    auto it = std::upper_bound(
        order_.begin(), order_.end(), p,
        [&](const uint8_t* x, int i) { return x < regions_[i].base; });
    if (it == order_.begin()) return -1;
    const ReceiptRegion& r = regions_[*(it - 1)];
    const int64_t off = p - static_cast<const uint8_t*>(r.base);
    const int64_t stride = r.rows > 1 ? r.row_stride_bytes : r.cols * r.es;
    *row = off / stride;
    *col = off % stride;
    if (*col % r.es != 0 || *row >= r.rows || *col / r.es >= r.cols) return -1;
    *col /= r.es;
    return *(it - 1);
  }

 private:
  const std::vector<ReceiptRegion>& regions_;
  std::vector<int> order_;
  int64_t elements_ = 0;
};

// Whether region g's rows are contiguous (one run of elements).
bool Dense(const ReceiptRegion& g) {
  return g.rows == 1 || g.row_stride_bytes == g.cols * g.es;
}

// The index of element (row, col) of region g.
uint64_t IndexIn(const ReceiptRegion& g, int64_t row, int64_t col) {
  return g.first_index +
         static_cast<uint64_t>(row) *
             static_cast<uint64_t>(g.row_stride_bytes / g.es) +
         static_cast<uint64_t>(col);
}

// Where a rectangle that a direct job writes lies in the regions: one group
// and salt, element (r, c) keyed first + r * row + c.
struct RectKeys {
  int32_t group = -1;
  uint64_t salt = 0;
  uint64_t first = 0;
  int64_t row = 0;
  bool row_known = false;
};

// Matches rows x cols elements of es bytes (row r at base + r * stride)
// against the regions; adds them to *covered. False where an element is
// outside the regions, or the rectangle is not keyed as one.
bool MatchRect(const RegionIndex& index,
               const std::vector<ReceiptRegion>& regions,
               const std::vector<int32_t>& group_of, const uint8_t* base,
               int64_t rows, int64_t cols, int64_t stride, int es,
               RectKeys* keys, int64_t* covered) {
  for (int64_t r = 0; r < rows;) {
    const uint8_t* p = base + r * stride;
    int64_t c = 0;
    int64_t done_rows = 1;
    while (c < cols) {
      int64_t row, col;
      const int i = index.Find(p + c * es, &row, &col);
      if (i < 0 || regions[i].es != es) return false;
      const ReceiptRegion& g = regions[i];
      const uint64_t at = IndexIn(g, row, col);
      if (r == 0 && c == 0) {
        keys->group = group_of[i];
        keys->salt = g.salt;
        keys->first = at;
      } else {
        if (group_of[i] != keys->group || g.salt != keys->salt) return false;
        if (!keys->row_known) {  // row 1's first piece
          keys->row = static_cast<int64_t>(at - keys->first);
          keys->row_known = true;
        }
        if (at != keys->first + static_cast<uint64_t>(r * keys->row + c)) {
          return false;
        }
      }
      const int64_t room =
          Dense(g) ? (g.rows - row) * g.cols - col : g.cols - col;
      const int64_t n = std::min(cols - c, room);
      if (c == 0 && n == cols && stride % es == 0 && rows - r > 1) {
        // The whole row in one region: the rows below in the same one, one
        // stride on each (the index too), are matched at once.
        const int64_t step = stride / es;
        int64_t more = 0;
        if (Dense(g)) {
          const int64_t left = g.rows * g.cols - (row * g.cols + col) - cols;
          more = step > 0 ? left / step : 0;
        } else if (stride == g.row_stride_bytes) {
          more = g.rows - row - 1;
        }
        more = std::min(more, rows - r - 1);
        if (keys->row_known && keys->row != step) more = 0;
        if (more > 0 && !keys->row_known) {
          keys->row = step;
          keys->row_known = true;
        }
        done_rows += more;
      }
      *covered += n * done_rows;
      c += n;
    }
    r += done_rows;
  }
  return true;
}

// Op o's rows cut into copy regions where they leave a region's row.
bool PlanCopy(const RegionIndex& index,
              const std::vector<ReceiptRegion>& regions,
              const std::vector<int32_t>& group_of, const FusedCopyOp& o,
              FusedReceiptPlan* plan, int64_t* covered) {
  const int64_t es = o.es;
  for (int64_t r = 0; r < o.rows; ++r) {
    const uint8_t* from = o.src + r * o.src_stride;
    uint8_t* to = o.dst + r * o.dst_stride;
    int64_t left = o.cols;
    while (left > 0) {
      int64_t row, col;
      const int i = index.Find(to, &row, &col);
      if (i < 0 || regions[i].es != es) return false;
      const ReceiptRegion& g = regions[i];
      // Contiguous rows of the region continue into the next one.
      const int64_t room =
          Dense(g) ? (g.rows - row) * g.cols - col : g.cols - col;
      const int64_t n = std::min(left, room);
      // The kernel moves 16-byte vectors: both sides equally misaligned.
      if ((reinterpret_cast<uintptr_t>(from) -
           reinterpret_cast<uintptr_t>(to)) %
              16 !=
          0) {
        return false;
      }
      ReceiptRegion c{};
      c.base = from;
      c.dst = to;
      c.rows = 1;
      c.cols = n;
      c.row_stride_bytes = n * es;
      c.dst_row_stride_bytes = n * es;
      c.es = static_cast<int32_t>(es);
      c.salt = g.salt;
      c.first_index = IndexIn(g, row, col);
      plan->copies.push_back(c);
      plan->copy_group.push_back(group_of[i]);
      plan->copy_chunk.push_back(o.chunk);
      *covered += n;
      left -= n;
      from += n * es;
      to += n * es;
    }
  }
  return true;
}

}  // namespace

bool PlanFusedReceipts(const std::vector<ReceiptRegion>& regions,
                       const std::vector<int32_t>& group_of,
                       const std::vector<FusedCopyOp>& ops,
                       const std::vector<DirectJob>& jobs,
                       FusedReceiptPlan* plan) {
  *plan = FusedReceiptPlan();
  const RegionIndex index(regions);
  int64_t covered = 0;
  for (const FusedCopyOp& o : ops) {
    if (o.rows <= 0 || o.cols <= 0) continue;
    if (!PlanCopy(index, regions, group_of, o, plan, &covered)) return false;
  }
  plan->direct.assign(jobs.size(), DirectReceipt{});
  plan->direct_group.assign(jobs.size(), -1);
  for (size_t k = 0; k < jobs.size(); ++k) {
    const QuantJob& out = jobs[k].out;
    if (out.rows <= 0 || out.width <= 0) continue;
    RectKeys q, s;
    if (!MatchRect(index, regions, group_of, out.q, out.rows, out.width,
                   out.q_stride, 1, &q, &covered)) {
      return false;
    }
    const int64_t grid_rows = (out.rows + out.block_rows - 1) / out.block_rows;
    const int64_t grid_cols = (out.width + out.block_cols - 1) / out.block_cols;
    if (!MatchRect(index, regions, group_of, out.scale, grid_rows, grid_cols,
                   4 * out.scale_stride, 4, &s, &covered) ||
        s.group != q.group) {
      return false;
    }
    // The kernel keys rows on the job's own strides (DirectReceipt).
    if ((q.row_known && q.row != out.q_stride) ||
        (s.row_known && s.row != out.scale_stride)) {
      return false;
    }
    DirectReceipt& rc = plan->direct[k];
    rc.out = nullptr;
    rc.q_salt = SaltOf(q.salt);
    rc.q_first = q.first;
    rc.scale_salt = SaltOf(s.salt);
    rc.scale_first = s.first;
    plan->direct_group[k] = q.group;
  }
  // Every element of the regions written once (the pieces lie inside
  // them; see the header for a plan that balances the count otherwise).
  return covered == index.elements();
}

}  // namespace cuda
}  // namespace weightsync
