"""Parses a node's /metrics text with the Prometheus project's own Python parser.

usage: parse_metrics.py openmetrics|prometheus FILE
Exits 0 and prints the number of families and samples if the text parses; exits 1
with the parser's error otherwise. The OpenMetrics parser is strict (it requires the
"# EOF" line, well-formed metadata, counters' _total samples, one block per family).
"""
import sys

from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics
from prometheus_client.parser import text_string_to_metric_families as prometheus

kind, path = sys.argv[1], sys.argv[2]
text = open(path, encoding="utf-8").read()
parse = openmetrics if kind == "openmetrics" else prometheus
try:
    families = list(parse(text))
except Exception as e:  # the parser raises ValueError and others for bad input
    print(f"{kind} parse error: {e!r}")
    sys.exit(1)
names = set()
for f in families:
    if f.name in names:
        print(f"{kind}: family {f.name} appears twice")
        sys.exit(1)
    names.add(f.name)
print(f"{len(families)} families, {sum(len(f.samples) for f in families)} samples")
