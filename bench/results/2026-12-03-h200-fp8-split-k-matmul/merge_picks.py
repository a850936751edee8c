import json, sys
a = json.load(open(sys.argv[1])); b = json.load(open(sys.argv[2]))
for k, v in b.items():
    a.setdefault(k, {}).update(v)
json.dump(a, open(sys.argv[3], "w"), indent=1)
print(json.dumps(a))
