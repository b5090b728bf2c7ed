"""Issue 29's six probe families rerun as real multi-process runs (``benchmarks/probe_families.py``).

- :mod:`.cases`: the grid (every registered strategy where a family applies), cases as JSON dicts;
- :mod:`.rank`: the script every rank runs under ``lowband run`` (a batch of cases, one after another);
- :mod:`.rank_cases`: what a rank does for each kind of case, and what it reports;
- :mod:`.orchestrate`: launches, the per-probe wall-clock bound, resuming a batch after a case that broke it;
- :mod:`.classify`: the outcome of a case from every rank's report and the launch's exit and stderr.
"""
