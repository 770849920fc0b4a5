import torch, flash_nif as fa, os
for d in (64, 128):
    for causal in (False, True):
        torch.manual_seed(0)
        b, s, h = 2, 300, 4
        q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        o, lse = fa.forward_with_states(q, k, v, causal=causal)
        g1 = fa.backward(do, q, k, v, o, lse, causal=causal)
        torch.cuda.synchronize()
        k1 = fa.info()["cuda"]["last_kernels"]["backward"]
        os.environ["FLASH_NIF_SM90"] = "0"
        g2 = fa.backward(do, q, k, v, o, lse, causal=causal)
        os.environ.pop("FLASH_NIF_SM90")
        errs = [float((a.float() - c.float()).abs().max()) for a, c in zip(g1, g2)]
        print(d, causal, k1["kernel"][:30], "maxdiff dq dk dv", errs, flush=True)
