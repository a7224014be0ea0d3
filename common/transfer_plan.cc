#include "common/transfer_plan.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/sha256.h"

namespace weightsync {
namespace {

struct Rect {
  int64_t r0 = 0, rn = 0, c0 = 0, cn = 0;
  bool operator<(const Rect& o) const {
    return std::tie(r0, c0, rn, cn) < std::tie(o.r0, o.c0, o.rn, o.cn);
  }
  bool operator==(const Rect& o) const {
    return r0 == o.r0 && rn == o.rn && c0 == o.c0 && cn == o.cn;
  }
};

std::string RectString(const Rect& r) {
  return absl::StrCat("rows [", r.r0, ", ", r.r0 + r.rn, ") cols [", r.c0, ", ",
                      r.c0 + r.cn, ")");
}

struct TensorInfo {
  int64_t rows = 0, cols = 0, esize = 0;
  bool empty = false;  // no elements: nothing to send
  // Held blocks (rect, sender) and needed blocks (rect, receiver), in
  // declaration order.
  std::vector<std::pair<Rect, int>> held, needed;
};

// A cell of a tensor's grid held by several senders (a replica): its rows
// are split between them once every single-holder byte is counted.
struct SharedCell {
  int32_t tensor = 0;
  Rect rect;
  std::vector<int> holders;    // ascending
  std::vector<int> receivers;  // ascending
};

absl::Status CheckBlock(const v1::TensorBlock& b, const TensorInfo& t,
                        const std::string& who, const v1::TensorSpec& spec) {
  const bool fits =
      b.row_begin() >= 0 && b.col_begin() >= 0 && b.row_count() >= 0 &&
      b.col_count() >= 0 && b.row_begin() <= t.rows &&
      b.row_count() <= t.rows - b.row_begin() && b.col_begin() <= t.cols &&
      b.col_count() <= t.cols - b.col_begin() &&
      (t.empty || (b.row_count() > 0 && b.col_count() > 0));
  if (fits) return absl::OkStatus();
  std::vector<int64_t> shape(spec.shape().begin(), spec.shape().end());
  return absl::InvalidArgumentError(absl::StrCat(
      "tensor '", b.tensor(), "': ", who, "'s block rows [", b.row_begin(),
      " +", b.row_count(), ") cols [", b.col_begin(), " +", b.col_count(),
      ") does not fit the tensor's 2-D view [", t.rows, ", ", t.cols,
      "] (shape ", ShapeString(shape), ") or is empty"));
}

// Validates the manifest and every block; fills `tensors`.
absl::Status Collect(const v1::TransferPlanSpec& spec,
                     const TransferPlanLimits& limits,
                     std::vector<TensorInfo>* tensors) {
  if (spec.senders_size() == 0) {
    return absl::InvalidArgumentError("transfer plan: no senders");
  }
  if (spec.receivers_size() == 0) {
    return absl::InvalidArgumentError("transfer plan: no receivers");
  }
  if (spec.senders_size() > limits.max_senders ||
      spec.receivers_size() > limits.max_receivers) {
    return absl::InvalidArgumentError(
        absl::StrCat("transfer plan: ", spec.senders_size(), " senders and ",
                     spec.receivers_size(), " receivers exceed the limits (",
                     limits.max_senders, ", ", limits.max_receivers, ")"));
  }
  int64_t blocks = 0;
  for (const auto& s : spec.senders()) blocks += s.holds_size();
  for (const auto& r : spec.receivers()) blocks += r.needs_size();
  if (blocks > limits.max_blocks) {
    return absl::InvalidArgumentError(absl::StrCat("transfer plan: ", blocks,
                                                   " blocks exceed the limit ",
                                                   limits.max_blocks));
  }
  if (spec.tensors_size() > limits.max_tensors) {
    return absl::InvalidArgumentError(
        absl::StrCat("transfer plan: ", spec.tensors_size(),
                     " tensors exceed the limit ", limits.max_tensors));
  }
  for (int r = 0; r < spec.receivers_size(); ++r) {
    if (static_cast<int64_t>(spec.receivers(r).name().size()) >
        limits.max_name_length) {
      return absl::InvalidArgumentError(absl::StrCat(
          "receiver ", r, ": a name of ", spec.receivers(r).name().size(),
          " bytes; the limit is ", limits.max_name_length));
    }
  }
  absl::flat_hash_map<std::string, int> index;
  tensors->resize(spec.tensors_size());
  for (int i = 0; i < spec.tensors_size(); ++i) {
    const v1::TensorSpec& t = spec.tensors(i);
    if (static_cast<int64_t>(t.name().size()) > limits.max_name_length ||
        t.shape_size() > limits.max_rank) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", i, " ('", t.name().substr(0, 64),
                       "'): a name of ", t.name().size(), " bytes and ",
                       t.shape_size(), " dimensions; the limits are ",
                       limits.max_name_length, " and ", limits.max_rank));
    }
    if (t.name().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor ", i, ": empty name"));
    }
    if (!index.emplace(t.name(), i).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name(), "' appears twice"));
    }
    absl::StatusOr<int64_t> payload = PayloadBytes(t);
    if (!payload.ok()) return payload.status();
    if (t.sparse_nnz() != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor '", t.name(),
                       "': a transfer plan carries dense tensors (sparse "
                       "patches follow the plan's pieces, not its spec)"));
    }
    if (t.has_quantization()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name(),
          "': a transfer plan carries tensors in their own dtypes (the "
          "daemons quantise what feeds an FP8 target); leave quantization "
          "unset"));
    }
    TensorInfo& info = (*tensors)[i];
    // The 2-D view segments use (engine_layout.h, SourceMatrix).
    info.rows = t.shape_size() == 0 ? 1 : t.shape(0);
    info.cols = 1;
    for (int d = 1; d < t.shape_size(); ++d) info.cols *= t.shape(d);
    info.esize = ElementSize(t.dtype());
    info.empty = *payload == 0;
  }
  auto add = [&](const v1::TensorBlock& b, const std::string& who, int rank,
                 bool held) -> absl::Status {
    auto it = index.find(b.tensor());
    if (it == index.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, " declares tensor '", b.tensor(), "', not in the manifest"));
    }
    TensorInfo& info = (*tensors)[it->second];
    absl::Status ok = CheckBlock(b, info, who, spec.tensors(it->second));
    if (!ok.ok()) return ok;
    if (info.empty) return absl::OkStatus();
    const Rect r{b.row_begin(), b.row_count(), b.col_begin(), b.col_count()};
    (held ? info.held : info.needed).emplace_back(r, rank);
    return absl::OkStatus();
  };
  for (int s = 0; s < spec.senders_size(); ++s) {
    for (const auto& b : spec.senders(s).holds()) {
      absl::Status ok = add(b, absl::StrCat("sender ", s), s, true);
      if (!ok.ok()) return ok;
    }
  }
  for (int r = 0; r < spec.receivers_size(); ++r) {
    const std::string who =
        absl::StrCat("receiver ", r, " ('", spec.receivers(r).name(), "')");
    for (const auto& b : spec.receivers(r).needs()) {
      absl::Status ok = add(b, who, r, false);
      if (!ok.ok()) return ok;
    }
  }
  return absl::OkStatus();
}

std::vector<int64_t> Cuts(int64_t end, const TensorInfo& t, bool rows) {
  std::vector<int64_t> cuts = {0, end};
  for (const auto* list : {&t.held, &t.needed}) {
    for (const auto& [r, who] : *list) {
      cuts.push_back(rows ? r.r0 : r.c0);
      cuts.push_back(rows ? r.r0 + r.rn : r.c0 + r.cn);
    }
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  return cuts;
}

int64_t CutIndex(const std::vector<int64_t>& cuts, int64_t v) {
  return std::lower_bound(cuts.begin(), cuts.end(), v) - cuts.begin();
}

std::string Ranks(const std::vector<int>& ranks) {
  return absl::StrJoin(ranks, ",");
}

// Cuts tensor `ti` into the grid of its blocks, checks that held blocks
// overlap only as identical replicas and that every needed cell is held,
// then emits the pieces of single-holder cells and lists the shared ones.
absl::Status PlanTensor(const v1::TransferPlanSpec& spec, int32_t ti,
                        const TensorInfo& t, const TransferPlanLimits& limits,
                        std::vector<PlanPiece>* pieces,
                        std::vector<SharedCell>* shared) {
  const std::string& name = spec.tensors(ti).name();
  // Distinct held rectangles, sorted, each with its holders.
  std::vector<std::pair<Rect, std::vector<int>>> groups;
  {
    std::vector<std::pair<Rect, int>> held = t.held;
    std::sort(held.begin(), held.end());
    for (const auto& [r, s] : held) {
      if (!groups.empty() && groups.back().first == r) {
        if (groups.back().second.back() == s) {
          return absl::InvalidArgumentError(
              absl::StrCat("tensor '", name, "': sender ", s, " declares ",
                           RectString(r), " twice"));
        }
        groups.back().second.push_back(s);
      } else {
        groups.push_back({r, {s}});
      }
    }
  }
  const std::vector<int64_t> rc = Cuts(t.rows, t, true);
  const std::vector<int64_t> cc = Cuts(t.cols, t, false);
  const int64_t nr = rc.size() - 1, nc = cc.size() - 1;
  if (nr * nc > limits.max_cells_per_tensor) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': its blocks cut it into ", nr, " x ",
                     nc, " cells, more than ", limits.max_cells_per_tensor));
  }
  std::vector<int32_t> owner(nr * nc, -1);
  for (size_t g = 0; g < groups.size(); ++g) {
    const Rect& r = groups[g].first;
    for (int64_t i = CutIndex(rc, r.r0); rc[i] < r.r0 + r.rn; ++i) {
      for (int64_t j = CutIndex(cc, r.c0); cc[j] < r.c0 + r.cn; ++j) {
        int32_t& o = owner[i * nc + j];
        if (o >= 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "tensor '", name, "': the block ", RectString(groups[o].first),
              " of sender(s) ", Ranks(groups[o].second), " overlaps the block ",
              RectString(r), " of sender(s) ", Ranks(groups[g].second),
              "; only identical blocks (replicas) may overlap"));
        }
        o = g;
      }
    }
  }
  std::vector<std::vector<int>> need(nr * nc);
  // t.needed is in receiver order (Collect adds receiver 0's blocks first),
  // so each cell's list of receivers comes out ascending, each once.
  for (const auto& [r, who] : t.needed) {
    for (int64_t i = CutIndex(rc, r.r0); rc[i] < r.r0 + r.rn; ++i) {
      for (int64_t j = CutIndex(cc, r.c0); cc[j] < r.c0 + r.cn; ++j) {
        std::vector<int>& n = need[i * nc + j];
        if (n.empty() || n.back() != who) n.push_back(who);
      }
    }
  }
  for (int64_t i = 0; i < nr; ++i) {
    for (int64_t j = 0; j < nc; ++j) {
      const std::vector<int>& n = need[i * nc + j];
      if (n.empty()) continue;
      const Rect cell{rc[i], rc[i + 1] - rc[i], cc[j], cc[j + 1] - cc[j]};
      const int32_t o = owner[i * nc + j];
      if (o < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "tensor '", name, "': ", RectString(cell), " needed by receiver ",
            n[0], " ('", spec.receivers(n[0]).name(),
            "') are held by no sender"));
      }
      const std::vector<int>& holders = groups[o].second;
      if (holders.size() > 1) {
        shared->push_back({ti, cell, holders, n});
        continue;
      }
      for (int r : n) {
        pieces->push_back({ti, cell.r0, cell.rn, cell.c0, cell.cn, holders[0],
                           r, cell.rn * cell.cn * t.esize});
      }
    }
  }
  return absl::OkStatus();
}

// Splits a shared cell's rows between its holders so that their loads
// rise as evenly as whole rows allow (docs/transfer_plan.md, "Replicas").
void WaterFill(const SharedCell& c, int64_t esize, std::vector<int64_t>* load,
               std::vector<PlanPiece>* pieces) {
  const int k = c.holders.size();
  const __int128 row_cost =
      static_cast<__int128>(c.rect.cn) * esize * c.receivers.size();
  const __int128 total = row_cost * c.rect.rn;
  std::vector<int> order = c.holders;
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return std::make_pair((*load)[a], a) < std::make_pair((*load)[b], b);
  });
  // The fewest least-loaded holders whose lift to the next one's load
  // absorbs the cell.
  int j = 1;
  __int128 sum = (*load)[order[0]];  // of the first j loads
  while (j < k && static_cast<__int128>((*load)[order[j]]) * j - sum < total) {
    sum += (*load)[order[j]];
    ++j;
  }
  std::vector<int64_t> rows(k, 0);  // by position in `order`
  int64_t given = 0;
  for (int i = 0; i < j; ++i) {
    rows[i] = static_cast<int64_t>(
        (sum + total - j * static_cast<__int128>((*load)[order[i]])) /
        (j * row_cost));
    given += rows[i];
  }
  // The remaining rows (fewer than j) go one each to the lowest resulting
  // loads, ties to the lower sender.
  std::vector<int> by_result(j);
  for (int i = 0; i < j; ++i) by_result[i] = i;
  std::sort(by_result.begin(), by_result.end(), [&](int a, int b) {
    const __int128 la = (*load)[order[a]] + rows[a] * row_cost;
    const __int128 lb = (*load)[order[b]] + rows[b] * row_cost;
    return la != lb ? la < lb : order[a] < order[b];
  });
  for (int64_t x = 0; x < c.rect.rn - given; ++x) ++rows[by_result[x]];
  // Contiguous row ranges in ascending sender order.
  std::vector<std::pair<int, int64_t>> share;
  for (int i = 0; i < k; ++i) share.emplace_back(order[i], rows[i]);
  std::sort(share.begin(), share.end());
  int64_t r0 = c.rect.r0;
  for (const auto& [s, n] : share) {
    if (n == 0) continue;
    for (int r : c.receivers) {
      pieces->push_back(
          {c.tensor, r0, n, c.rect.c0, c.rect.cn, s, r, n * c.rect.cn * esize});
      (*load)[s] += n * c.rect.cn * esize;
    }
    r0 += n;
  }
}

// Joins pieces of one link and tensor that share rows and touch (left to
// right), then those that share columns and touch (top to bottom).
void Merge(std::vector<PlanPiece>* pieces) {
  auto key = [](const PlanPiece& p) {
    return std::make_tuple(p.sender, p.receiver, p.tensor, p.row_begin,
                           p.col_begin);
  };
  auto col_key = [](const PlanPiece& p) {
    return std::make_tuple(p.sender, p.receiver, p.tensor, p.col_begin,
                           p.col_count, p.row_begin);
  };
  auto pass = [&](auto sort_key, auto joins, auto join) {
    std::sort(pieces->begin(), pieces->end(),
              [&](const PlanPiece& a, const PlanPiece& b) {
                return sort_key(a) < sort_key(b);
              });
    std::vector<PlanPiece> out;
    for (const PlanPiece& p : *pieces) {
      if (!out.empty() && joins(out.back(), p)) {
        join(&out.back(), p);
      } else {
        out.push_back(p);
      }
    }
    *pieces = std::move(out);
  };
  auto same_link = [](const PlanPiece& a, const PlanPiece& b) {
    return a.sender == b.sender && a.receiver == b.receiver &&
           a.tensor == b.tensor;
  };
  pass(
      key,
      [&](const PlanPiece& a, const PlanPiece& b) {
        return same_link(a, b) && a.row_begin == b.row_begin &&
               a.row_count == b.row_count &&
               a.col_begin + a.col_count == b.col_begin;
      },
      [](PlanPiece* a, const PlanPiece& b) {
        a->col_count += b.col_count;
        a->bytes += b.bytes;
      });
  pass(
      col_key,
      [&](const PlanPiece& a, const PlanPiece& b) {
        return same_link(a, b) && a.col_begin == b.col_begin &&
               a.col_count == b.col_count &&
               a.row_begin + a.row_count == b.row_begin;
      },
      [](PlanPiece* a, const PlanPiece& b) {
        a->row_count += b.row_count;
        a->bytes += b.bytes;
      });
  std::sort(
      pieces->begin(), pieces->end(),
      [&](const PlanPiece& a, const PlanPiece& b) { return key(a) < key(b); });
}

std::string BlockText(const char* tag, const v1::TensorBlock& b) {
  return absl::StrCat(tag, " ", b.tensor().size(), ":", b.tensor(), " ",
                      b.row_begin(), " ", b.row_count(), " ", b.col_begin(),
                      " ", b.col_count(), "\n");
}

}  // namespace

std::string TransferPlanId(const v1::TransferPlanSpec& spec) {
  Sha256 h;
  h.Update(absl::StrCat("weightsync transfer plan ", kTransferPlanSpecVersion,
                        "\n"));
  for (const v1::TensorSpec& t : spec.tensors()) {
    h.Update(absl::StrCat(
        "T ", t.name().size(), ":", t.name(), " ", static_cast<int>(t.dtype()),
        " ", absl::StrJoin(t.shape(), ","), " ", t.sparse_nnz(), "\n"));
  }
  for (int s = 0; s < spec.senders_size(); ++s) {
    h.Update(absl::StrCat("S ", s, "\n"));
    for (const auto& b : spec.senders(s).holds()) h.Update(BlockText("H", b));
  }
  for (int r = 0; r < spec.receivers_size(); ++r) {
    const std::string& n = spec.receivers(r).name();
    h.Update(absl::StrCat("R ", r, " ", n.size(), ":", n, "\n"));
    for (const auto& b : spec.receivers(r).needs()) h.Update(BlockText("N", b));
  }
  const std::array<uint8_t, 32> digest = h.Final();
  return absl::StrCat("tp", kTransferPlanSpecVersion, "-",
                      absl::BytesToHexString(absl::string_view(
                          reinterpret_cast<const char*>(digest.data()), 8)));
}

absl::StatusOr<TransferPlan> BuildTransferPlan(
    const v1::TransferPlanSpec& spec, const TransferPlanLimits& limits) {
  std::vector<TensorInfo> tensors;
  absl::Status ok = Collect(spec, limits, &tensors);
  if (!ok.ok()) return ok;
  TransferPlan plan;
  plan.id = TransferPlanId(spec);
  plan.manifest = spec.tensors();
  plan.num_senders = spec.senders_size();
  plan.num_receivers = spec.receivers_size();
  std::vector<SharedCell> shared;
  std::vector<bool> used(tensors.size(), false);
  for (int32_t i = 0; i < static_cast<int32_t>(tensors.size()); ++i) {
    if (tensors[i].empty) continue;
    const size_t before = plan.pieces.size() + shared.size();
    ok = PlanTensor(spec, i, tensors[i], limits, &plan.pieces, &shared);
    if (!ok.ok()) return ok;
    used[i] = plan.pieces.size() + shared.size() > before;
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!used[i]) plan.unused.push_back(spec.tensors(i).name());
  }
  std::vector<int64_t> load(plan.num_senders, 0);
  for (const PlanPiece& p : plan.pieces) load[p.sender] += p.bytes;
  // Largest shared cells first, so the small ones even out what is left;
  // cells of one size keep the order PlanTensor listed them in (tensor,
  // then row, then column), as the plan's canonical order requires.
  auto cell_bytes = [&](const SharedCell& c) {
    return static_cast<__int128>(c.rect.rn) * c.rect.cn *
           tensors[c.tensor].esize * c.receivers.size();
  };
  std::stable_sort(shared.begin(), shared.end(),
                   [&](const SharedCell& a, const SharedCell& b) {
                     return cell_bytes(a) > cell_bytes(b);
                   });
  for (const SharedCell& c : shared) {
    WaterFill(c, tensors[c.tensor].esize, &load, &plan.pieces);
  }
  Merge(&plan.pieces);
  plan.links.assign(plan.num_senders,
                    std::vector<std::vector<int32_t>>(plan.num_receivers));
  plan.sender_bytes.assign(plan.num_senders, 0);
  plan.receiver_bytes.assign(plan.num_receivers, 0);
  for (int32_t k = 0; k < static_cast<int32_t>(plan.pieces.size()); ++k) {
    const PlanPiece& p = plan.pieces[k];
    plan.links[p.sender][p.receiver].push_back(k);
    plan.sender_bytes[p.sender] += p.bytes;
    plan.receiver_bytes[p.receiver] += p.bytes;
  }
  return plan;
}

Manifest LinkManifest(const TransferPlan& plan, int sender, int receiver) {
  Manifest m;
  for (int32_t k : plan.links[sender][receiver]) {
    const PlanPiece& p = plan.pieces[k];
    const v1::TensorSpec& t = plan.manifest.Get(p.tensor);
    v1::TensorSpec* s = m.Add();
    s->set_name(absl::StrCat(t.name(), "[", p.row_begin, ":",
                             p.row_begin + p.row_count, ",", p.col_begin, ":",
                             p.col_begin + p.col_count, "]"));
    s->set_dtype(t.dtype());
    s->add_shape(p.row_count);
    s->add_shape(p.col_count);
  }
  return m;
}

}  // namespace weightsync
