"""Model versions shipped between machines and regions as signed, content-addressed chunk sets.

    manifest.py   the store layout, manifests, Ed25519 keys and signatures
    ship.py       publish (folder -> store) and sync (store -> a verified, loadable folder)

The commands `infermesh model keygen | publish | sync` live in infermesh/checkpoints_cli.py.
Nothing here is imported until a checkpoint command runs (cryptography and zstandard load then).
"""
