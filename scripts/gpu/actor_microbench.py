"""GPU: forward + backward of SmolLM2-135M-Instruct with PEFT LoRA r8 (transformers, sdpa, bf16 autocast) on 8k and 16k
tokens, padded and packed: what the actor's model work costs without verl around it (docs/learning.md, step time).

    python3 scripts/gpu/actor_microbench.py      # needs /tmp/qerl_smollm2/bf16 (examples/smollm2/prepare.py)
"""
import time

import torch
from transformers import AutoModelForCausalLM
from peft import LoraConfig, get_peft_model
m = AutoModelForCausalLM.from_pretrained("/tmp/qerl_smollm2/bf16", dtype=torch.float32, attn_implementation="sdpa").cuda()
m = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
def run(ids, pos, mask, label, reps=3):
    ts=[]
    for _ in range(reps+1):
        torch.cuda.synchronize(); t=time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(input_ids=ids, position_ids=pos, attention_mask=mask)
            loss = out.logits.float().log_softmax(-1).mean()
        loss.backward()
        torch.cuda.synchronize(); ts.append(time.perf_counter()-t)
    print(f"{label:40s} fwd+bwd {min(ts[1:])*1000:8.1f} ms  peak {torch.cuda.max_memory_allocated()/2**30:.1f} GiB", flush=True)
    torch.cuda.reset_peak_memory_stats()
V=49152
ids=torch.randint(0,V,(64,128),device="cuda"); mask=torch.ones_like(ids)
run(ids, None, mask, "padded 64x128 (8192 tok)")
ids1=ids.reshape(1,-1); pos=torch.arange(128,device="cuda").repeat(64).reshape(1,-1)
run(ids1, pos, None, "packed 1x8192, pos restart")
ids2=torch.randint(0,V,(1,16384),device="cuda"); pos2=torch.arange(128,device="cuda").repeat(128).reshape(1,-1)
run(ids2, pos2, None, "packed 1x16384, pos restart")
