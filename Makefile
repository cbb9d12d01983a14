# vitlab: `make pretrain` (Tiny-ImageNet-200, 16 -> 32px), then `make finetune` (Imagenette, 72px);
# `make test` checks everything.
#
#   RECIPE=  recipe YAML (defaults below)      DATA=   image folder, shard folder(s), cifar10 or cifar100
#   RUN=     run folder (everything lands here) CKPT=   what finetune starts from
#   GPUS=    devices per node (DDP when > 1)    NODES=  number of nodes
#   LOGGER=  wandb to log to Weights & Biases too (offline without an API key)
#   ARGS=    extra CLI flags, e.g. ARGS=--ckpt_path=last to resume the same run
#   RESOLUTION_ARGS=  flags for the `vitlab resolution` that ends `make finetune`, e.g. --limit-batches 10
#
# The device check (bench/gpu_check.py): `make gpu-data gpu-wheels` here, then on the GPU machine
# `make gpu-check OUT=dir` (its own python3, the wheels from .whl/, vitlab from this tree);
# `make gpu-check DEVICE=cpu OUT=dir` runs the same checks at tiny sizes on the CPU.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTHON ?= python3
VITLAB := $(VENV)/bin/vitlab

PRETRAIN_RECIPE ?= recipes/pretrain/tinyimagenet_vit_cpu.yaml
FINETUNE_RECIPE ?= recipes/finetune/imagenette_72px_cpu.yaml
PRETRAIN_RUN    ?= runs/pretrain
FINETUNE_RUN    ?= runs/finetune
SHARED_SUBSET   ?= ../shared/data/cifar10-subset
SHARED_DATA     ?= ../shared/data

comma := ,
# Flags every training command shares: data, devices, nodes, loggers.
COMMON = $(if $(DATA),--data_path $(DATA)) \
         $(if $(GPUS),--trainer.accelerator=gpu --trainer.devices=$(GPUS) $(if $(filter-out 1,$(GPUS)),--trainer.strategy=ddp)) \
         $(if $(NODES),--trainer.num_nodes=$(NODES)) \
         $(if $(LOGGER),--loggers='[tensorboard$(comma)csv$(comma)$(LOGGER)]')

.PHONY: install test pretrain finetune dashboard bench bench-accuracy bench-transfer gpu-check gpu-data gpu-wheels clean

install: $(VENV)/.installed

# pyproject.toml declares the version ranges vitlab works with; constraints.txt pins what CI tests.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -c constraints.txt -e '.[dev]'
	touch $@

test: install
	$(PY) -m pytest tests $(PYTEST_ARGS)

pretrain: install
	$(VITLAB) fit --config $(or $(RECIPE),$(PRETRAIN_RECIPE)) --run_dir $(or $(RUN),$(PRETRAIN_RUN)) $(COMMON) $(ARGS)

# What finetune starts from: CKPT=, else the recipe's own init_from (a hub ViT), else the pretrain run.
FT_RECIPE = $(or $(RECIPE),$(FINETUNE_RECIPE))
FT_SOURCE = $(or $(CKPT),$(if $(shell grep -qE '^ +init_from: *[^ #]' $(FT_RECIPE) 2>/dev/null && echo own),,$(PRETRAIN_RUN)/checkpoints/last.ckpt))

# Ends with `vitlab resolution`: top-1 against test size for the source and the fine-tuned model.
finetune: install
	$(VITLAB) fit --config $(FT_RECIPE) --run_dir $(or $(RUN),$(FINETUNE_RUN)) \
		$(if $(FT_SOURCE),--model.init_from $(FT_SOURCE)) $(COMMON) $(ARGS)
	$(VITLAB) resolution --run $(or $(RUN),$(FINETUNE_RUN)) $(RESOLUTION_ARGS)

dashboard: install  # PORT= (default 6006), LOGDIR= (default runs/)
	$(VENV)/bin/tensorboard --logdir $(or $(LOGDIR),runs) --port $(or $(PORT),6006) --bind_all

bench: install
	$(PY) bench/bench_model.py $(BENCH_ARGS)
	$(PY) bench/bench_pipeline.py --data $(or $(DATA),$(SHARED_SUBSET))
	$(PY) bench/bench_precision.py

bench-accuracy: install
	$(PY) bench/bench_accuracy.py --data $(or $(DATA),$(SHARED_SUBSET)) $(BENCH_ARGS)

bench-transfer: install
	$(PY) bench/bench_transfer.py --pretrain-data $(SHARED_DATA)/tinyimagenet-200-shards \
		--finetune-data $(SHARED_DATA)/imagenette-128-shards $(BENCH_ARGS)

# ---- the prepared device run -------------------------------------------------------------------
# Missing on the GPU machine's python3 (pure Python), fetched as wheels for Python 3.12 at the versions
# constraints.txt pins; the machine already has torch, Lightning, numpy, pyarrow, fsspec, xxhash...
GPU_WHEELS   ?= jsonargparse docstring-parser typeshed-client webdataset braceexpand torchdata datasets dill multiprocess
GPU_PLATFORM := $(foreach p,manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64,--platform $(p))
GPU_PY       ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))

gpu-wheels:
	rm -rf .whl && mkdir -p .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORM) -c constraints.txt -d .whl $(GPU_WHEELS)
	@du -sh .whl

gpu-data:  # small subsets of the shared shards (the device receives 64 MiB at most)
	$(PYTHON) scripts/pack_gpu_data.py --src $(SHARED_DATA) --out .gpudata $(GPU_DATA_ARGS)

# gpu-check makes .gpudata first where it is missing (its cifar10/train is what gpu_check.py looks for).
.gpudata/cifar10/train:
	$(MAKE) gpu-data

gpu-check: | .gpudata/cifar10/train  # DEVICE=cpu: tiny sizes; OUT=: report folder (default $$OUT, else runs/gpu-check)
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) bench/gpu_check.py --device $(or $(DEVICE),auto) \
		--data .gpudata --out $(or $(OUT),runs/gpu-check) $(GPU_CHECK_ARGS)

clean:
	rm -rf runs lightning_logs
