# Every target bootstraps .venv by itself: `make lab` or `make test` on a fresh clone is enough.
# `make lab` installs what a student needs (requirements.txt); test, lint, html and slides add the contributor
# tooling (requirements-dev.txt) on top.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DEV_STAMP := $(VENV)/.installed-dev-stamp
PRESENT_STAMP := $(VENV)/.installed-present-stamp

.PHONY: setup dev lab test test-gpu html slides present release grade lint clean \
        bench-forward bench-ablate bench-peak bench-hopper bench-backward bench-backward-hopper bench-targets bench-decode bench-memory bench-train bench-ring bench-sparse bench-cpu \
        profile profile-occupancy profile-backward profile-backward-hopper profile-decode profile-sparse profile-stream-k sanitize

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; v = sys.version_info[:2]; (3, 10) <= v <= (3, 12) or print("warning: FlashLab is tested on Python 3.10-3.12, not", sys.version.split()[0])'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $(STAMP)

dev: $(DEV_STAMP)

$(DEV_STAMP): $(STAMP) requirements-dev.txt
	$(BIN)/python -m pip install --quiet -r requirements-dev.txt
	touch $(DEV_STAMP)

# JupyterLab serves the course's root, so that a chapter's "Lab:" link (../labs/...), data/ and docs/ are in reach,
# and opens on chapter 1. Options of your own go in LAB_ARGS, after ours so that they win:
# make lab LAB_ARGS="--no-browser --port 8890".
# Jupyter refuses to start as root (containers, some cloud VMs) unless told to.
LAB_FIRST      := notebooks/01_online_softmax.ipynb
LAB_ALLOW_ROOT  = $(if $(filter 0,$(shell id -u)),--allow-root)
LAB_ARGS       ?=

lab: setup
	$(BIN)/jupyter lab $(LAB_ALLOW_ROOT) --ServerApp.root_dir=. --LabApp.default_url=/lab/tree/$(LAB_FIRST) $(LAB_ARGS)

test: dev
	$(BIN)/python -m pytest -q

test-gpu: dev
	$(BIN)/python -m pytest -q -m gpu

html: dev
	$(BIN)/python -m flashlab html --out build/html

slides: dev
	$(BIN)/python -m flashlab slides --out build/slides

$(PRESENT_STAMP): $(STAMP) requirements-instructor.txt
	$(BIN)/python -m pip install --quiet -r requirements-instructor.txt
	touch $(PRESENT_STAMP)

# Chapter CHAPTER (default 7) as live slides in JupyterLab with RISE: its slide cells, every other cell skipped,
# written to build/present/. There: Run > Run All Cells (on a GPU machine the GPU cells run live), save, then
# Alt+R: the slides share the notebook's kernel. make present CHAPTER=3 LAB_ARGS="--no-browser --port 8890".
CHAPTER ?= 7
present: $(PRESENT_STAMP)
	path=$$($(BIN)/python -m flashlab slides --present $(CHAPTER) --out build/present) && \
	$(BIN)/jupyter lab $(LAB_ALLOW_ROOT) --ServerApp.root_dir=. --LabApp.default_url=/lab/tree/$$path $(LAB_ARGS)

release: setup
	$(BIN)/python -m flashlab release

grade: setup
	$(BIN)/python -m flashlab grade $(or $(SUBMISSIONS),submissions/) --out gradebook/

# Recorded results: one target per kind, each with the arguments that made the files in data/ (the "command" in
# their provenance). data/README.md lists every file, what reads it and the target that regenerates it.
BENCH := $(BIN)/python -m flashlab bench

bench-forward: setup
	$(BENCH) forward --repeat 20 --warmup 3
	$(BENCH) forward --name memory_sweep --impls cupy_naive scalar smem_tiles warp32 sdpa_flash --d 64 \
	    --n 1024 2048 4096 8192 16384 32768 --causal no --heads 16 --batch 1 --slow-max-n 8192 --repeat 20 --warmup 2
	$(BENCH) forward --name memory_sweep_rung2 --impls cupy_naive smem_tiles sdpa_flash --d 64 --n 16384 32768 \
	    --causal no --heads 16 --batch 1 --slow-max-n 32768 --repeat 20 --warmup 2

bench-backward: setup
	$(BENCH) backward --n 4096 16384 --causal no --impls sdpa_flash ours_pipe ours_mma sdpa_cudnn --repeat 20 --warmup 3

# The runs that hold the course's speed targets, each a line of the target that owns its record and, together,
# `make bench-targets`: one run on one GPU of the forward that "best" runs on sm_90 against SDPA (each backend
# picked once), the Hopper backward, and decoding at both shapes, every table under both protocols.
BENCH_BWD_HOPPER = backward --name bwd_hopper --impls sdpa_flash ours_wgmma ours_wgmma_overlap ours_wgmma_bulk \
    ours_wgmma_balanced ours_pipe sdpa_cudnn --d 64 128 --n 4096 16384 --causal both --dtypes float16 bfloat16 \
    --repeat 20 --warmup 3 --rounds 2
HOPPER_PINNED = forward --name hopper_pinned --impls tma stream_k sdpa_flash sdpa_cudnn --d 64 128 \
    --n 1024 4096 16384 --causal both --dtypes float16 bfloat16 --repeat 20 --warmup 3 --rounds 2
DECODE_DEPENDENT = decode --name decode_dependent --m 131072 --heads 32 --kv-heads 8 --kernels mma --splits \
    --dependent-merge --repeat 20 --warmup 3 --rounds 4
DECODE_MHA = decode --name decode_mha --m 65536 --kernels mma --splits --repeat 20 --warmup 3 --rounds 4

bench-targets: setup
	$(BENCH) $(HOPPER_PINNED)
	$(BENCH) $(BENCH_BWD_HOPPER)
	$(BENCH) $(DECODE_MHA)
	$(BENCH) $(DECODE_DEPENDENT)

# Hopper (H100, H200 only): the four wgmma backward kernels against "pipe" and SDPA's two backends, d 64 and 128,
# causal and not, fp16 and bf16, both orders (--rounds 2).
bench-backward-hopper: setup
	$(BENCH) $(BENCH_BWD_HOPPER)

# Rungs 6 and 8 with one change undone at a time (chapter 7).
bench-ablate: setup
	$(BENCH) ablate

# The tensor-core ceiling of mma.sync that chapter 7 sets each rung against.
bench-peak: setup
	$(BENCH) peak

# Hopper (H100, H200 only): the wgmma ceiling beside mma.sync's, and the wgmma rungs against the best mma.sync rungs
# and SDPA's two backends, in one run each.
bench-hopper: setup
	$(BENCH) peak --name peak_hopper --impls wgmma mma_sync --warps 4 8 12
	$(BENCH) forward --name hopper --impls wgmma tma specialized overlap three_stages fused_exp rescale_under_s \
	    persistent balanced three_blocks k_lanes sdpa_flash sdpa_cudnn --d 64 128 \
	    --n 1024 4096 16384 --causal both --dtypes float16 bfloat16 --repeat 20 --warmup 3
	$(BENCH) forward --name hopper_merged --impls tma balanced merged sdpa_flash sdpa_cudnn --d 64 128 \
	    --n 1024 4096 16384 --causal both --dtypes float16 bfloat16 --repeat 20 --warmup 3
	$(BENCH) forward --name hopper_staged --impls tma merged staged sdpa_flash sdpa_cudnn --d 64 128 \
	    --n 1024 4096 16384 --causal both --dtypes float16 bfloat16 --repeat 20 --warmup 3
	$(BENCH) forward --name hopper_stream_k --impls tma staged stream_k sdpa_flash sdpa_cudnn --d 64 128 \
	    --n 1024 4096 16384 --causal both --dtypes float16 bfloat16 --repeat 20 --warmup 3
	$(BENCH) forward --name hopper_stream_k_first --impls tma stream_k staged sdpa_flash sdpa_cudnn --d 64 128 \
	    --n 1024 4096 16384 --causal both --dtypes float16 bfloat16 --repeat 20 --warmup 3
	$(BENCH) forward --name hopper_stream_k_rounds --impls tma staged stream_k sdpa_flash sdpa_cudnn --d 64 128 \
	    --n 1024 4096 16384 --causal both --dtypes float16 bfloat16 --repeat 20 --warmup 3 --rounds 2
	$(BENCH) $(HOPPER_PINNED)

bench-decode: setup
	$(BENCH) decode --m 65536 --splits 4 16 20 41 64 128 256 --repeat 20 --warmup 3 --rounds 2
	$(BENCH) decode --name decode_gqa --m 131072 --heads 32 --kv-heads 8 --kernels keys mma --splits 16 33 66 132 264 \
	    --repeat 20 --warmup 3 --rounds 2
	$(BENCH) decode --name decode_fused --m 131072 --heads 32 --kv-heads 8 --kernels mma fused --repeat 20 --warmup 3 \
	    --rounds 2
	$(BENCH) $(DECODE_DEPENDENT)
	$(BENCH) $(DECODE_MHA)

bench-memory: setup
	$(BENCH) memory --n 1024 4096 16384 --repeat 20

bench-train: setup
	$(BENCH) train --steps 400 --repeat 20

# Chapter 10's ring on two GPUs of one host (NCCL_DEBUG=INFO prints the transport NCCL chose).
bench-ring: setup
	NCCL_DEBUG=INFO $(BENCH) ring --n 131072 --heads 16 --repeat 20 --warmup 3

# Block-sparse attention against its density, dense causal and FlexAttention with the same mask, in one run.
bench-sparse: setup
	$(BENCH) sparse --repeat 20 --warmup 3

# Chapter 5's CPU run, at raised priority (as recorded; without the right to raise it, nice warns and runs anyway).
CPU_RECORD ?= xeon-2core
bench-cpu: setup
	nice -n -10 $(BENCH) cpu --record $(CPU_RECORD)

# Nsight Compute: raw CSVs into data/raw/ncu/, the summaries the chapters read into data/ncu/.
NCU          := ncu --clock-control none --profile-from-start off --csv
PROFILE      := $(BENCH) profile
DRAM         := --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum
LADDER       := --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,$\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,$\
l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,sm__warps_active.avg.pct_of_peak_sustained_active,$\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum
SECTIONS     := --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis_Tables
INSTRUCTIONS := --metrics smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,$\
gpu__time_duration.sum
PAPER_SHAPE  := --d 64 --n 1024 --batch 64
LADDER_SHAPE := --d 128 --n 2048 --batch 8
RUNGS_1_7    := scalar smem_tiles mma ldmatrix cp_async exp2_tiles warp32
# $(call ncu_csv,IMPLS,NCU OPTIONS,SHAPE,CSV): one profiled process per implementation, all into data/raw/ncu/CSV
ncu_csv = for i in $(1); do $(NCU) $(2) $(PROFILE) --impl $$i $(3) || exit 1; done > data/raw/ncu/$(4)
# $(call ncu_summary,CSV,NAME): data/ncu/NAME.json from data/raw/ncu/CSV
ncu_summary = $(PROFILE) summarize data/raw/ncu/$(1) build/ncu_provenance.json > data/ncu/$(2).json

profile: setup
	mkdir -p build data/raw/ncu
	$(PROFILE) provenance --command "make profile" > build/ncu_provenance.json
	$(call ncu_csv,cupy_naive exp2_tiles warp32 sdpa_flash,$(DRAM),$(PAPER_SHAPE),ncu_paper_shape.csv)
	$(call ncu_csv,lean,$(DRAM),$(PAPER_SHAPE),ncu_paper_lean.csv)
	$(call ncu_csv,addressing sdpa_flash,$(DRAM),$(PAPER_SHAPE),ncu_paper_final.csv)
	$(call ncu_csv,$(RUNGS_1_7),$(LADDER),$(LADDER_SHAPE),ncu_ladder_metrics.csv)
	$(call ncu_csv,$(RUNGS_1_7),$(SECTIONS),$(LADDER_SHAPE),ncu_ladder_sections.csv)
	$(call ncu_csv,lean addressing,$(INSTRUCTIONS),$(LADDER_SHAPE),ncu_r9.csv)
	$(call ncu_summary,ncu_paper_shape.csv,paper_shape_dram)
	$(call ncu_summary,ncu_paper_lean.csv,paper_shape_dram_lean)
	$(call ncu_summary,ncu_paper_final.csv,paper_shape_dram_final)
	$(call ncu_summary,ncu_ladder_metrics.csv,ladder_metrics)
	$(call ncu_summary,ncu_r9.csv,instructions_lean_addressing)

# Rung 12 against rung 11 at d = 64: three resident blocks per SM instead of two, and what that does to the time the
# tensor pipe is busy (chapter 7). Its own target: a minute of profiling rather than the whole of `make profile`.
OCCUPANCY_SHAPE := --d 64 --n 4096 --batch 4
profile-occupancy: setup
	mkdir -p build data/raw/ncu
	$(PROFILE) provenance --command "make profile-occupancy" > build/ncu_provenance.json
	$(call ncu_csv,k_lanes three_blocks,$(LADDER),$(OCCUPANCY_SHAPE),ncu_occupancy_r12.csv)
	$(call ncu_summary,ncu_occupancy_r12.csv,occupancy_k_lanes_three_blocks)

# The backward kernel "pipe" under ncu (its main kernel only, d = 64 and 128): why its warps stall, per issued
# instruction, beside the tensor pipe and occupancy; then SDPA's flash backward (its main kernel) at d = 128.
STALL_REASONS := barrier branch_resolving dispatch_stall drain imc_miss lg_throttle long_scoreboard \
                 math_pipe_throttle membar mio_throttle misc no_instruction not_selected selected short_scoreboard \
                 sleeping tex_throttle wait
empty :=
space := $(empty) $(empty)
comma := ,
STALLS := --metrics $(subst $(space),$(comma),$(foreach r,$(STALL_REASONS),smsp__average_warps_issue_stalled_$(r)_per_issue_active.ratio)),$\
smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,$\
sm__warps_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum
# One GQA decoding step (32 query heads on 8 K/V heads, 131072 keys) of each fast split kernel under ncu, as a text
# report: instructions issued per key, how often the schedulers issue, how busy DRAM is (chapter 8, docs/kernels.md).
DECODE_SECTIONS := --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
    --section MemoryWorkloadAnalysis --section InstructionStats --section LaunchStats
DECODE_SHAPE := --pass decode --d 128 --n 1 --batch 1 --heads 32 --kv-heads 8 --m 131072

# Rung H12 beside H11 without a mask (d = 128, n = 4096, batch 4, 2048 tiles on 132 SMs): the spread of the SMs'
# active cycles is the last round's tail (docs/kernels.md, the Hopper rungs).
TAIL := --metrics sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_active.min,sm__cycles_elapsed.max,$\
gpu__time_duration.sum
profile-stream-k: setup
	mkdir -p data/raw/ncu
	for impl in staged stream_k; do ncu --profile-from-start off --clock-control none --csv $(TAIL) \
	    $(PROFILE) --impl $$impl --d 128 --n 4096 --batch 4; done > data/raw/ncu/ncu_stream_k_tail.csv 2>&1

# Block-sparse (H100, H200): the Hopper window kernel at the narrow windows where time per tile misses dense
# causal's, beside dense causal itself; the sections say where an output tile's time goes (memory, issue), the stall
# counters (one CSV, summarized into data/ncu/stalls_sparse_window.json) why its warps wait.
SPARSE_SHAPE := --d 128 --n 16384 --batch 1 --heads 16
profile-sparse: setup
	mkdir -p build data/raw/ncu data/ncu
	ncu --profile-from-start off --clock-control none $(DECODE_SECTIONS) $(PROFILE) --impl best --causal \
	    $(SPARSE_SHAPE) > data/raw/ncu/ncu_sparse_window.txt 2>&1
	$(foreach w,256 512 2048,ncu --profile-from-start off --clock-control none $(DECODE_SECTIONS) $(PROFILE) \
	    --impl hopper_window --window $(w) $(SPARSE_SHAPE) >> data/raw/ncu/ncu_sparse_window.txt 2>&1;)
	$(PROFILE) provenance --command "make profile-sparse" > build/ncu_provenance.json
	$(NCU) $(GMMA_STALLS) $(PROFILE) --impl best --causal $(SPARSE_SHAPE) > data/raw/ncu/ncu_sparse_stalls.csv
	$(foreach w,256 512 2048,$(NCU) $(GMMA_STALLS) $(PROFILE) --impl hopper_window --window $(w) $(SPARSE_SHAPE) \
	    >> data/raw/ncu/ncu_sparse_stalls.csv &&) true
	$(call ncu_summary,ncu_sparse_stalls.csv,stalls_sparse_window)

profile-decode: setup
	mkdir -p data/raw/ncu
	ncu --profile-from-start off --clock-control none $(DECODE_SECTIONS) $(PROFILE) --impl keys $(DECODE_SHAPE) \
	    > data/raw/ncu/ncu_decode_keys_gqa.txt
	ncu --profile-from-start off --clock-control none $(DECODE_SECTIONS) $(PROFILE) --impl mma $(DECODE_SHAPE) \
	    > data/raw/ncu/ncu_decode_mma_gqa.txt
	for impl in mma fused; do ncu --profile-from-start off --clock-control none $(DECODE_SECTIONS) $(PROFILE) \
	    --impl $$impl $(DECODE_SHAPE); done > data/raw/ncu/ncu_decode_fused_gqa.txt 2>&1

profile-backward: setup
	mkdir -p build data/raw/ncu
	$(PROFILE) provenance --command "make profile-backward" > build/ncu_provenance.json
	$(NCU) -k regex:bwd_pipe $(STALLS) $(PROFILE) --pass backward --impl pipe --d 64 --n 4096 --batch 4 \
	    > data/raw/ncu/ncu_bwd_pipe.csv
	$(NCU) -k regex:bwd_pipe $(STALLS) $(PROFILE) --pass backward --impl pipe --d 128 --n 4096 --batch 4 \
	    >> data/raw/ncu/ncu_bwd_pipe.csv
	$(NCU) -k regex:flash_bwd_dq_dk_dv $(STALLS) $(PROFILE) --pass backward --impl sdpa_flash --d 128 --n 4096 \
	    --batch 4 > data/raw/ncu/ncu_bwd_sdpa.csv
	$(call ncu_summary,ncu_bwd_pipe.csv,stalls_bwd_pipe)
	$(call ncu_summary,ncu_bwd_sdpa.csv,stalls_bwd_sdpa_flash)

# The Hopper backward kernels under the same metrics, with wgmma's own tensor pipe (gmma) beside mma.sync's (hmma)
# (Nsight Compute on the H200 answered n/a for the gmma metric in the recorded run).
GMMA_STALLS := $(STALLS),sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active
BWD_HOPPER := wgmma wgmma_overlap wgmma_bulk wgmma_balanced
profile-backward-hopper: setup
	mkdir -p build data/raw/ncu
	$(PROFILE) provenance --command "make profile-backward-hopper" > build/ncu_provenance.json
	rm -f data/raw/ncu/ncu_bwd_wgmma.csv
	$(foreach k,$(BWD_HOPPER),$(foreach d,64 128,$(NCU) -k regex:bwd_wgmma $(GMMA_STALLS) $(PROFILE) --pass backward \
	    --impl $(k) --d $(d) --n 4096 --batch 4 >> data/raw/ncu/ncu_bwd_wgmma.csv &&)) true
	$(call ncu_summary,ncu_bwd_wgmma.csv,stalls_bwd_wgmma)

# Every kernel once at ragged shapes under compute-sanitizer; fails on any memory error or race.
# --report-api-errors no: the driver binding that builds TMA tensor maps (cuda-bindings) probes for entry points
# this driver may lack, and each miss is an API error; a failing call of ours raises in Python anyway, so the
# sanitizer reports device memory errors only.
sanitize: setup
	compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 $(BIN)/python -m flashlab selfcheck
	compute-sanitizer --tool racecheck --error-exitcode 1 $(BIN)/python -m flashlab selfcheck

lint: dev
	$(BIN)/ruff check flashlab tests tools

clean:
	rm -rf $(VENV) build
