# vitlab: `make pretrain`, then `make finetune`; `make test` checks everything.
#
#   RECIPE=  recipe YAML (defaults below)      DATA=   image folder, shard folder, cifar10 or cifar100
#   RUN=     run folder (everything lands here) CKPT=   what finetune starts from
#   GPUS=    devices per node (DDP when > 1)    NODES=  number of nodes
#   LOGGER=  wandb to log to Weights & Biases too (offline without an API key)
#   ARGS=    extra CLI flags, e.g. ARGS=--ckpt_path=last to resume the same run
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTHON ?= python3
VITLAB := $(VENV)/bin/vitlab

PRETRAIN_RECIPE ?= recipes/pretrain/cifar10_vit_tiny_cpu.yaml
FINETUNE_RECIPE ?= recipes/finetune/cifar10_vit_tiny_64px_cpu.yaml
PRETRAIN_RUN    ?= runs/pretrain
FINETUNE_RUN    ?= runs/finetune
SHARED_SUBSET   ?= ../shared/data/cifar10-subset

comma := ,
# Flags every training command shares: data, devices, nodes, loggers.
COMMON = $(if $(DATA),--data_path $(DATA)) \
         $(if $(GPUS),--trainer.accelerator=gpu --trainer.devices=$(GPUS) $(if $(filter-out 1,$(GPUS)),--trainer.strategy=ddp)) \
         $(if $(NODES),--trainer.num_nodes=$(NODES)) \
         $(if $(LOGGER),--loggers='[tensorboard$(comma)csv$(comma)$(LOGGER)]')

.PHONY: install test pretrain finetune dashboard bench bench-accuracy clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -e '.[dev]'
	touch $@

test: install
	$(PY) -m pytest tests $(PYTEST_ARGS)

pretrain: install
	$(VITLAB) fit --config $(or $(RECIPE),$(PRETRAIN_RECIPE)) --run_dir $(or $(RUN),$(PRETRAIN_RUN)) $(COMMON) $(ARGS)

finetune: install
	$(VITLAB) fit --config $(or $(RECIPE),$(FINETUNE_RECIPE)) --run_dir $(or $(RUN),$(FINETUNE_RUN)) \
		--model.init_from $(or $(CKPT),$(PRETRAIN_RUN)/checkpoints/last.ckpt) $(COMMON) $(ARGS)

dashboard: install
	$(VENV)/bin/tensorboard --logdir runs --bind_all

bench: install
	$(PY) bench/bench_model.py $(BENCH_ARGS)
	$(PY) bench/bench_pipeline.py --data $(or $(DATA),$(SHARED_SUBSET))

bench-accuracy: install
	$(PY) bench/bench_accuracy.py --data $(or $(DATA),$(SHARED_SUBSET)) $(BENCH_ARGS)

clean:
	rm -rf runs lightning_logs
