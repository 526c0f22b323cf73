"""The measuring harness the benchmark scripts use: memory, time and recomputed FLOPs, from outside the library.

It lives in the library (``remat/_inspection/measure.py``), where :func:`remat.compare` and :func:`remat.sequential`'s cost
model use it too; the benchmark package imports it from there, never the other way round
(``tests/test_layout.py``).
"""

from .._inspection.measure import (
                        Config,
                        FlopCount,
                        LiveCensus,
                        MiB,
                        Progress,
                        Result,
                        format_table,
                        live_bytes_after,
                        measure,
                        pareto_front,
                        plot,
                        ratio,
                        saved_bytes,
                        ties,
                        time_better,
)

__all__ = ["Config", "FlopCount", "LiveCensus", "MiB", "Progress", "Result", "format_table", "live_bytes_after",
           "measure", "pareto_front", "plot", "ratio", "saved_bytes", "ties", "time_better"]
