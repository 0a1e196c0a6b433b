"""Each instance's own llama-server metrics, re-exported with its node, model and instance (metrics core, pure).

llama-server started with `--metrics` answers `GET /metrics` in the Prometheus text format with its `llamacpp:*`
families (prompt and generated tokens and their seconds, requests processing and deferred, decode calls, …).
`relabel` parses one instance's answer with prometheus-client's own parser and returns its families with the
instance's labels on every sample; the fold merges the families of all instances by name. Rules it keeps:

* Only the engine's own families (`llamacpp:` names) pass; anything else in the answer is left out.
* A counter whose samples do not end in `_total` (llama-server's `llamacpp:n_tokens_max`, a largest value seen)
  is re-exported as a gauge of the same name: exposition formats name a counter's samples `<family>_total`.
* An answer that does not parse is refused whole (`ValueError`): no half of an instance's figures.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from actors.metrics.families import ENGINE_PREFIX

__all__ = ["relabel"]

_TYPE_LINE = re.compile(r"^# TYPE (\S+) (\S+)", re.MULTILINE)


def relabel(text: str, labels: Mapping[str, str]) -> list[Metric]:
    """The `llamacpp:` families of one llama-server's `/metrics` answer, each sample labelled with `labels`
    (which replace labels of the same names). ValueError: the answer does not parse."""
    try:
        parsed = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as exc:  # the parser's ways of saying "not the text format"
        raise ValueError(f"not Prometheus text: {exc}") from exc
    # the parser names every counter's samples `<family>_total`: which ones the server named otherwise
    untotalled = {name for name, kind in _TYPE_LINE.findall(text) if kind == "counter" and not name.endswith("_total")}
    out: list[Metric] = []
    for family in parsed:
        if not family.name.startswith(ENGINE_PREFIX):
            continue
        if family.type == "counter" and family.name in untotalled:
            metric = Metric(family.name, family.documentation, "gauge")
            for sample in family.samples:
                metric.samples.append(Sample(family.name, {**sample.labels, **labels}, sample.value))
        else:
            metric = Metric(family.name, family.documentation, family.type)
            for sample in family.samples:
                metric.samples.append(Sample(sample.name, {**sample.labels, **labels}, sample.value))
        out.append(metric)
    return out
