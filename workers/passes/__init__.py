"""What every pass of a model over a job's data uses, estimators and job running alike: the
dataset a batch at a time (``data.py``, ``images.py``), the hooks a pass reports to and asks
(``hooks.py``), compiling and timing optimizer steps (``steps.py``) and predictions on held-out
target samples (``predictions.py``). Below workers/estimators/ and workers/running/, so neither
imports the other for them."""
