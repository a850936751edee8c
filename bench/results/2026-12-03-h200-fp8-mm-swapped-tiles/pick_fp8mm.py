import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
base = {(r["shape"], r["M"]): r["us"] for r in rows if r.get("kernel") == "scaled_mm"}
best = {}
for r in rows:
    if r.get("kernel") != "triton" or "us" not in r or r["rel_err"] > 3e-3:
        continue
    k = (r["shape"], r["M"])
    if k not in best or r["us"] < best[k][0]:
        best[k] = (r["us"], r["config"], r["N"], r["K"])
picks = {}
for (shape, M), (us, cfg, N, K) in sorted(best.items()):
    win = us < 0.95 * base[(shape, M)]
    picks.setdefault(f"{N}x{K}", {})[str(M)] = cfg if win else None
    print(f"{shape:8s} M={M:4d} scaled_mm {base[(shape, M)]:7.2f} best {us:7.2f} {cfg} {'PICK' if win else ''}")
json.dump(picks, open(sys.argv[2], "w"), indent=1)
