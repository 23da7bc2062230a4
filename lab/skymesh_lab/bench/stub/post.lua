-- wrk script of the router-overhead benchmark: POST chat completions, print a summary.
--
--   wrk ... -s post.lua URL -- MODE STREAM [GROUPS]
--   MODE   fixed:  the same small body every request (round-robin cases);
--          prefix: GROUPS long shared prefixes (a "system prompt" of ~2 KB each), every
--                  request one of them plus a question of its own, so a cache-aware
--                  router has prefixes to keep together and a trie that grows.
--   STREAM 1 asks for a streamed answer.
-- done() prints one line "WRKJSON {...}" (latencies in microseconds) for the harness.

local counter = 0
local threads = {}

function setup(thread)
   thread:set("id", counter)
   table.insert(threads, thread)
   counter = counter + 1
end

local mode, stream, groups, prefixes, n, tid

local function words(seed, count)
   local out = {}
   local x = seed
   for i = 1, count do
      -- a small LCG: the same prefix text for a group in every thread and every run
      x = (x * 1103515245 + 12345) % 2147483648
      out[i] = "w" .. tostring(x % 5000)
   end
   return table.concat(out, " ")
end

function init(args)
   mode = args[1] or "fixed"
   stream = (args[2] == "1") and "true" or "false"
   groups = tonumber(args[3] or "16")
   tid = id or 0
   n = 0
   prefixes = {}
   for g = 1, groups do
      prefixes[g] = "You are assistant " .. g .. ". Context: " .. words(g * 7919, 320)
   end
   wrk.method = "POST"
   wrk.headers["Content-Type"] = "application/json"
   if mode == "fixed" then
      wrk.body = '{"model":"stub","messages":[{"role":"user","content":"Say hi."}],' ..
         '"max_tokens":64,"stream":' .. stream .. '}'
   end
end

function request()
   if mode == "fixed" then
      return wrk.format(nil, nil, nil, wrk.body)
   end
   n = n + 1
   local g = ((n * 7 + tid * 13) % groups) + 1
   local body = '{"model":"stub","messages":[{"role":"system","content":"' .. prefixes[g] ..
      '"},{"role":"user","content":"question ' .. tid .. "-" .. n .. '"}],' ..
      '"max_tokens":64,"stream":' .. stream .. '}'
   return wrk.format(nil, nil, nil, body)
end

function done(summary, latency, requests)
   local e = summary.errors
   io.write(string.format(
      'WRKJSON {"requests":%d,"duration_us":%d,"bytes":%d,"connect_errors":%d,' ..
      '"read_errors":%d,"write_errors":%d,"status_errors":%d,"timeouts":%d,' ..
      '"lat_mean_us":%.1f,"lat_p50_us":%d,"lat_p90_us":%d,"lat_p99_us":%d,' ..
      '"lat_p999_us":%d,"lat_max_us":%d}\n',
      summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write,
      e.status, e.timeout, latency.mean, latency:percentile(50), latency:percentile(90),
      latency:percentile(99), latency:percentile(99.9), latency.max))
end
