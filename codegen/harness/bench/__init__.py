"""``python -m codegen bench``: the selected SKUs timed against a device copy and PyTorch, recorded.

One module per job:

    cli.py        the command line (``bench``, ``bench --render``) and the steps of a run
    plan.py       what a run measures: SKUs x workload modules x shapes
    run.py        one workload measured: input sets, baselines, a copy of the same bytes
    timing.py     the CUDA-event Timer, the device copy, rotation sets, the arithmetic of the figures
    baselines.py  PyTorch eager and torch.compile of a workload's composite
    host.py       host overhead of repeated functional calls
    record.py     a GPU's bench record: derived figures, merge, targets
    report.py     the record's Markdown page and chart
    steps.py      step time of the examples (``--examples``)

The method, the default selection, the workload modules' interface and the record formats:
docs/audit.md, "python -m codegen bench".
"""
