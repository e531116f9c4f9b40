"""`batchspec bench`: methods side by side on the same prompts, models and machine.

specbench.py picks prompts (SpecBench task groups, stratified), methods.py parses `method@batch`
specs, runner.py times our engine and Hugging Face's own `generate`, exactness.py compares every
output with the plain-decoding oracle, report.py turns runs into figures/tables/JSON/CSV and
plots.py draws them.
"""
