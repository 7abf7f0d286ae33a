# Sourced by benchmarks/gpu.sh before a `memstudy tune` step: where Propulate and an MPI library
# do not import, installs them offline from the wheels in $TUNE_WHEELS (default $WHEELS/tune,
# i.e. .whl/tune; the list is in benchmarks/BENCHMARKS.md, "Reproduce"; docs/tune.md,
# "Installation"). Nothing happens where they already import. Everything but `mpich` goes into
# one folder put first on PYTHONPATH ($TUNE_SITE); `mpich` is installed with --prefix, since
# --target drops the wheel's lib/ folder where libmpi.so.12 lives, and MPI4PY_LIBMPI points
# mpi4py at it.
tune_wheels="${TUNE_WHEELS:-${WHEELS:-.whl}/tune}"
tune_site="${TUNE_SITE:-${TMPDIR:-/tmp}/memstudy-tune}"
if ! python3 -c "import propulate; from mpi4py import MPI" 2>/dev/null; then
    pip_here="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
    $pip_here --target "$tune_site/site" $(ls "$tune_wheels"/*.whl | grep -v /mpich-) &&
        $pip_here --prefix "$tune_site/mpich" "$tune_wheels"/mpich-*.whl &&
        export PYTHONPATH="$tune_site/site${PYTHONPATH:+:$PYTHONPATH}" \
               MPI4PY_LIBMPI="$tune_site/mpich/lib/libmpi.so.12" &&
        python3 -c "import propulate; from mpi4py import MPI; print('propulate', propulate.__version__, '|', MPI.Get_library_version().splitlines()[0])" ||
        echo "tune_env: propulate / MPI not importable from $tune_wheels (see docs/tune.md)"
fi
