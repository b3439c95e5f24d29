"""What a node's Python environment holds, read by that Python without importing torch: the code the pre-flight
(jobs/preflight.py) and the node survey (cluster/provision.py) run there."""

# Reads torch/version.py without importing torch (an import costs seconds on every launch), and the
# installed distributions' metadata (NCCL as pip ships it for torch, every package for the job's record);
# a torch that is present but broken still fails fast at rank start, with its last lines shown.
VERSION_CODE = (
    "import ast,importlib.util,json,os,sys\n"
    "try:\n"
    "    import importlib.metadata as md\n"
    "    pk = sorted({'%s==%s' % ((d.metadata['Name'] or '?').lower(), d.version) for d in md.distributions()})\n"
    "except Exception:\n"
    "    pk = []\n"
    "nccl = [p.split('==')[1] for p in pk if p.startswith('nvidia-nccl')]\n"
    "base = {'python': sys.version.split()[0], 'nccl': nccl[0] if nccl else None, 'packages': pk[:3000]}\n"
    "try:\n"
    "    spec = importlib.util.find_spec('torch')\n"
    "    if spec is None or not spec.submodule_search_locations:\n"
    "        raise ImportError('No module named torch')\n"
    "    path = os.path.join(list(spec.submodule_search_locations)[0], 'version.py')\n"
    "    found = {}\n"
    "    for st in ast.parse(open(path).read()).body:\n"
    "        target = st.targets[0] if isinstance(st, ast.Assign) else getattr(st, 'target', None)\n"
    "        if isinstance(target, ast.Name) and target.id in ('__version__', 'cuda') and st.value is not None:\n"
    "            found[target.id] = ast.literal_eval(st.value)\n"
    "    print(json.dumps(dict(base, torch=found.get('__version__'), cuda=found.get('cuda'))))\n"
    "except Exception as e:\n"
    "    print(json.dumps(dict(base, error='%s: %s' % (type(e).__name__, e))))\n"
)
