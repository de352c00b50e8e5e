#include <map>
#include <vector>

#include "bench/bench.h"
#include "gtest/gtest.h"

namespace aqswarm::bench {
namespace {

// Steps [first, first + n * runs) of the cycle: how often each cell runs, and
// how often each cell runs a step of each phase mod `period`.
struct Counts {
  std::map<int, int> per_cell;
  std::map<std::pair<int, int>, int> per_cell_phase;
};
Counts Count(const std::vector<int>& cycle, int n, int period, int first, int runs) {
  Counts c;
  for (int g = first; g < first + n * runs; ++g) {
    const int k = cycle[g % cycle.size()];
    EXPECT_GE(k, 0);
    EXPECT_LT(k, n);
    ++c.per_cell[k];
    if (period > 0) ++c.per_cell_phase[{k, g % period}];
  }
  return c;
}

TEST(SweepCellCycleTest, CoprimePeriodsKeepThePlainCycle) {
  for (int period : {0, 1, 3, 5}) {
    const std::vector<int> c = SweepCellCycle(4, period, /*first=*/7);
    ASSERT_EQ(c.size(), 4u) << period;
    for (int g = 0; g < 4; ++g) EXPECT_EQ(c[g], g) << period;
  }
}

// QuantizedAdam refreshes its variance every 4th step: with 4 or 2
// bandwidths a plain cycle gives every refresh to one cell.
TEST(SweepCellCycleTest, EveryCellMeetsEveryPhaseOfThePeriodEqually) {
  for (int n : {2, 4, 6}) {
    for (int first : {0, 3, 7}) {
      const int period = 4;
      const std::vector<int> c = SweepCellCycle(n, period, first);
      const int lcm = n == 6 ? 12 : 4;
      ASSERT_EQ(static_cast<int>(c.size()), n * lcm);
      // Whole cycles: each (cell, phase) pair equally often.
      const Counts all = Count(c, n, period, first, static_cast<int>(c.size()));
      ASSERT_EQ(static_cast<int>(all.per_cell_phase.size()), n * period) << n << " " << first;
      for (const auto& [key, count] : all.per_cell_phase) {
        EXPECT_EQ(count, all.per_cell_phase.begin()->second) << "n " << n << " cell " << key.first;
      }
      // Any whole number of aligned runs from `first`: each cell equally often.
      for (int runs : {1, 3, 6, 10}) {
        Counts some = Count(c, n, period, first, runs);
        for (int k = 0; k < n; ++k) EXPECT_EQ(some.per_cell[k], runs) << "n " << n << " runs " << runs;
      }
    }
  }
}

TEST(SweepCellCycleTest, APlainCycleWouldHaveGivenEveryRefreshToOneCell) {
  // The case the rotation exists for, stated on the plain cycle itself.
  std::map<int, int> refresh_cells;
  for (int g = 0; g < 64; g += 4) ++refresh_cells[g % 4];
  EXPECT_EQ(refresh_cells.size(), 1u);
  const std::vector<int> c = SweepCellCycle(4, 4, 0);
  std::map<int, int> rotated;
  for (int g = 0; g < 64; g += 4) ++rotated[c[g % c.size()]];
  EXPECT_EQ(rotated.size(), 4u);
}

}  // namespace
}  // namespace aqswarm::bench
