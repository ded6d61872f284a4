# Each target creates .venv on first use. torch is pinned and installed first, on its own,
# so that no later resolution can pull a CUDA build; the extras (dev, demo: matplotlib, docs:
# mkdocs) then resolve against the project's own torch==2.13.0 pin, so they never move it.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed

.PHONY: demo test docs bench golden clean

$(VENV_STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,demo,docs]'
	touch $(VENV_STAMP)

demo: $(VENV_STAMP)
	$(PY) -m autopar demo

test: $(VENV_STAMP)
	.venv/bin/lint-imports
	.venv/bin/ruff check .
	$(PY) -m pytest tests

# the documentation site into site/ (open site/index.html); --strict: any warning fails
docs: $(VENV_STAMP)
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict

# after a meant change to a pass, lowering or the printer: rewrite tests/passes/golden/ (read the diff)
golden: $(VENV_STAMP)
	AUTOPAR_UPDATE_GOLDEN=1 $(PY) -m pytest tests/passes/test_golden_dumps.py

# every CPU benchmark of bench/ (docs/benchmarks.md); not here: gpu_check.py and
# multi_gpu_check.py (CUDA only), placement_ilp.py (the placement ILP alone: run it when
# changing auto/), profile_step.py and ranks.py (the benchmarks' helpers)
bench: $(VENV_STAMP)
	$(PY) bench/serial.py
	$(PY) bench/overhead.py
	$(PY) bench/compile.py --memory
	$(PY) bench/plan.py
	$(PY) bench/plan_scale.py
	$(PY) bench/dp_vs_ddp.py
	$(PY) bench/dp_vs_ddp.py --compile
	$(PY) bench/tp_vs_dtensor.py
	$(PY) bench/tp_vs_dtensor.py --plan mlp
	$(PY) bench/tp_vs_dtensor.py --sequence-parallel
	$(PY) bench/tp_vs_dtensor.py --compile
	$(PY) bench/pp_vs_pipelining.py
	$(PY) bench/pp_memory.py
	$(PY) bench/zero_memory.py
	$(PY) bench/zero_vs_dp.py
	$(PY) bench/zero_vs_fsdp2.py
	$(PY) bench/zero_vs_fsdp2.py --compile
	$(PY) bench/memory_estimate.py
	$(PY) bench/recompute.py
	$(PY) bench/amp.py
	$(PY) bench/checkpoint.py
	$(PY) bench/cost_model.py
	$(PY) bench/auto_plan.py
	$(PY) bench/async_checkpoint.py
	$(PY) bench/context_parallel.py
	$(PY) bench/variable_lengths.py
	$(PY) bench/packing.py

clean:
	rm -rf .venv
