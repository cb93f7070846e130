import torch, time, subprocess, json
a=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16); b=torch.randn_like(a)
for _ in range(5): a@b
torch.cuda.synchronize()
def smi():
    return subprocess.run(["nvidia-smi","--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active","--format=csv,noheader"],capture_output=True,text=True).stdout.strip()
res={}
for rep in range(3):
    t=time.time(); n=0
    while time.time()-t<4:
        for _ in range(20): a@b
        n+=20
    torch.cuda.synchronize(); dt=time.time()-t
    res[f"mm{rep}"]=dict(tflops=round(2*8192**3*n/dt/1e12,1), smi=smi())
x=torch.empty(2*1024**3//2,dtype=torch.bfloat16,device='cuda'); y=torch.empty_like(x)
for rep in range(3):
    torch.cuda.synchronize(); t=time.time()
    for _ in range(50): y.copy_(x)
    torch.cuda.synchronize(); dt=time.time()-t
    res[f"copy{rep}"]=dict(GBps=round(2*x.numel()*2*50/dt/1e9), smi=smi())
print(json.dumps(res,indent=1))
