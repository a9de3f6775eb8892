# call 5: where arle serve's main thread spends a concurrency-64 run (py-spy), and h11 vs httptools
bash scripts/gpu_session.sh >/dev/null 2>&1; export PYTHONPATH=/tmp/site:$PWD
{ python3 -c "import uvloop; print('uvloop', uvloop.__version__)"; python3 -c "import httptools; print('httptools', httptools.__version__)"; python3 -c "import uvicorn; print('uvicorn', uvicorn.__version__)"; } > $OUT/env.txt 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/prof .prof/py_spy*.whl >> $OUT/env.txt 2>&1
python3 -m pip install -q --no-index --no-deps --target /tmp/ht .prof/httptools*.whl >> $OUT/env.txt 2>&1
python3 scripts/make_random_model.py qwen3-4b /tmp/models/qwen3-4b >/dev/null 2>&1
bench() { python3 -m arle bench --base-url http://127.0.0.1:8200 --num-prompts 64 --random-input-len 512 --random-output-len 128 --max-concurrency 64 --warmup-requests 2 --seed $1 --quiet --output-file $2 > /dev/null 2>&1; python3 -c "import json,sys; d=json.load(open('$2')); print('$2', round(d['output_throughput']), round(d['mean_tpot_ms'],3), round(d['mean_ttft_ms'],1))" >> $OUT/summary.txt; }
serve() { python3 -m arle serve --model /tmp/models/qwen3-4b --port 8200 --log-format json > /tmp/serve_$1.log 2>&1 & SP=$!; for i in $(seq 300); do curl -sf http://127.0.0.1:8200/health >/dev/null && break; sleep 0.5; done; echo "ready $1 after ${i} polls" >> $OUT/summary.txt; }
serve default
bench 11 /tmp/b_def1.json
/tmp/prof/bin/py-spy record -p $SP -r 500 -f raw -o $OUT/spy_c64_default.txt -d 8 --nonblocking --threads --idle > /tmp/spy.log 2>&1 &
PS=$!; sleep 1; bench 21 /tmp/b_def2.json; wait $PS; cat /tmp/spy.log | tail -3 >> $OUT/summary.txt
bench 31 /tmp/b_def3.json
kill $SP; wait $SP
PYTHONPATH=/tmp/ht:$PYTHONPATH serve httptools
bench 41 /tmp/b_ht1.json; bench 51 /tmp/b_ht2.json; bench 61 /tmp/b_ht3.json
kill $SP; wait $SP
cat $OUT/summary.txt
