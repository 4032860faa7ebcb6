"""The launch advisor: the fastest parallel layout that fits, before launch.

    from examples.llama import llama3_70b
    from planner.search import search

    result = search(llama3_70b, "64xh100", global_batch=512, seq_len=8192)
    print(result.table_text())

or ``sac-plan search --model examples:llama3_70b --gpus 64xh100 --global-batch 512 --seq-len 8192``.
The design, the time model and measured tables: docs/search.md.
"""

from planner.search.layouts import Cluster, Layout, SearchSpace
from planner.search.search import SearchOptions, SearchResult, search

__all__ = ["search", "Cluster", "Layout", "SearchSpace", "SearchOptions", "SearchResult"]
