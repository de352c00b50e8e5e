#!/usr/bin/env bash
# Every metric name a dashboard (or Grafana variable) uses is exported by the
# binary: names come from `aqswarm metrics list` (the catalogue each component
# declares), never from a list kept here. Histogram series (_bucket, _sum,
# _count) count as their histogram.
set -u
bin="$1"; dashboards="$2"
catalog=$("$bin" metrics list) || { echo "FAIL: aqswarm metrics list exited with $?"; exit 1; }
mapfile -t names < <(awk '{print $1}' <<<"$catalog")
[[ ${#names[@]} -gt 10 ]] || { echo "FAIL: catalogue has only ${#names[@]} metrics"; exit 1; }
declare -A known type
while read -r n t _; do known[$n]=1; type[$n]=$t; done <<<"$catalog"
fail=0; used=0
shopt -s nullglob
files=("$dashboards"/*.json)
[[ ${#files[@]} -ge 3 ]] || { echo "FAIL: expected at least 3 dashboards in $dashboards"; exit 1; }
for f in "${files[@]}"; do
  while read -r m; do
    used=$((used + 1))
    base=$m
    for suffix in _bucket _sum _count; do
      if [[ $m == *"$suffix" && ${type[${m%"$suffix"}]:-} == histogram ]]; then base=${m%"$suffix"}; fi
    done
    if [[ -z ${known[$base]:-} ]]; then
      echo "FAIL $(basename "$f"): '$m' is not exported (aqswarm metrics list)"; fail=1
    fi
  done < <(grep -o 'aqswarm_[a-z0-9_]*' "$f" | sort -u)
done
[[ $used -gt 0 ]] || { echo "FAIL: no aqswarm_ metric found in any dashboard"; exit 1; }
[[ $fail -eq 0 ]] && echo "ok: $used metric names used by ${#files[@]} dashboards are all exported"
exit $fail
