# Sourced by benchmarks/gpu.sh before a `memstudy tune` step: makes Propulate and an MPI library
# importable on the GPU machine from the wheels carried in .whl/tune (docs/tune.md,
# "Installation"; the list is in benchmarks/BENCHMARKS.md). Nothing happens where they already
# import. Everything but `mpich` is unpacked with --target into /tmp/site-tune; `mpich` goes
# in with --prefix (--target drops the wheel's lib/ folder, where libmpi.so.12 lives) and
# MPI4PY_LIBMPI points mpi4py at it. TUNE_WHEELS names another folder of wheels.
tune_wheels="${TUNE_WHEELS:-.whl/tune}"
if ! python3 -c "import propulate; from mpi4py import MPI" 2>/dev/null; then
    pip_here="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
    $pip_here --target /tmp/site-tune $(ls "$tune_wheels"/*.whl | grep -v /mpich-) &&
        $pip_here --prefix /tmp/mpich-tune "$tune_wheels"/mpich-*.whl &&
        export PYTHONPATH="/tmp/site-tune${PYTHONPATH:+:$PYTHONPATH}" \
               MPI4PY_LIBMPI=/tmp/mpich-tune/lib/libmpi.so.12 &&
        python3 -c "import propulate; from mpi4py import MPI; print('propulate', propulate.__version__, '|', MPI.Get_library_version().splitlines()[0])" ||
        echo "tune_env: propulate / MPI not importable from $tune_wheels (see docs/tune.md)"
fi
