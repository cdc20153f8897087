"""The operator's tools, above the services: the `infermesh` command (cli.py), the launcher behind
`infermesh up` (launcher.py, supervise.py), `infermesh top` (top.py), `make demo` (demo.py), and
`infermesh model keygen | publish | sync` (checkpoints_cli.py).

Layering, kept by tests/unit/test_layout.py: infermesh may import services, mesh and meshkernels;
services may import mesh and meshkernels; mesh/ never imports services/ (nor infermesh/), and
meshkernels/ imports neither mesh/ nor services/.
"""
