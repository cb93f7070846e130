python3 scripts/gpu/check_actor_kernels.py --steps model --shape 32b --model-iters 7 --model-tokens 4096 --model-cases bf16,nvfp4,nvfp4+keep16,nvfp4+keep24,nvfp4+keep28,nvfp4+keep32 --out /tmp/r/t4096_order1 > /tmp/r/t4096_order1.log 2>&1
if grep -q '"case": "bf16", .*"error"' /tmp/r/t4096_order1/check_actor_kernels.jsonl; then
  python3 scripts/gpu/check_actor_kernels.py --steps model --shape 32b --model-iters 7 --model-tokens 2048 --model-cases bf16,nvfp4,nvfp4+keep16,nvfp4+keep24,nvfp4+keep32,nvfp4+keep40 --out /tmp/r/t2048_order1 > /tmp/r/t2048_order1.log 2>&1
else
  python3 scripts/gpu/check_actor_kernels.py --steps model --shape 32b --model-iters 7 --model-tokens 4096 --model-cases nvfp4+keep32,nvfp4+keep28,nvfp4+keep24,nvfp4+keep16,nvfp4,bf16 --out /tmp/r/t4096_order2 > /tmp/r/t4096_order2.log 2>&1
fi
touch /tmp/r/DONE
