"""`python -m engine.kernels`: build the kernel library now and print its path."""

from engine.kernels.build import main

raise SystemExit(main())
