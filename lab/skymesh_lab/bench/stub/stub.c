/* A fast OpenAI-compatible stub backend for the router-overhead benchmark.
 *
 * One thread, epoll, HTTP/1.1 keep-alive: every answer is ready-made text, so a request
 * costs the stub microseconds and the routers in front of it are what the benchmark
 * measures. It answers what the routers send:
 *
 *   POST /v1/chat/completions, /v1/completions, /generate
 *       non-streaming: one small chat.completion object;
 *       "stream": true: K server-sent events (one token each), then "data: [DONE]",
 *       in one chunked reply written at once.
 *   GET  /health, /health_generate, /readiness, /liveness   -> 200
 *   GET  /v1/models                                        -> the one model, "stub"
 *   GET  /metrics   -> vLLM-style gauges (num_requests_running/waiting = 0), so a prober
 *                      that reads vLLM's /metrics sees an idle, healthy replica; and
 *                      stub_prefix_lookups_total / stub_prefix_hits_total (below)
 *   GET  /get_server_info, /get_model_info, /model_info, /server_info, /get_load
 *                   -> small JSON (sglang-router and vllm-router ask at startup)
 *   anything else   -> 404 (and the path on stderr with -v, to find what a router needs),
 *                      among them vllm-router's per-request POST /tokenize and
 *                      /v1/chat/completions/render in its cache_aware policy: a fast 404,
 *                      after which it routes on the request's text
 *
 * A prefix cache, modelled only as far as a hit rate needs: each completion's first
 * message text (up to PREFIX_BYTES of it) is hashed and looked up among the CACHE most
 * recently seen (LRU; 0, the default, keeps none and counts nothing). With fewer slots than
 * the client has shared prefixes, a prefix stays cached only while a router keeps sending
 * it to the same stub: the hit rate at the stubs says how well a router kept prefixes
 * together, whatever the router publishes itself.
 *
 * Build: gcc -O2 -o stub stub.c     Run: ./stub PORT [K] [CACHE] [-v]
 * It prints "ready PORT" on stdout once listening (PORT 0 picks a free port).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_EVENTS 256
#define MAX_REQ (1 << 20) /* a request larger than this closes the connection */

typedef struct {
    int fd;
    char *in;
    size_t in_len, in_cap;
    char *out;
    size_t out_len, out_off, out_cap;
    int want_close;
    int waiting_out; /* registered for EPOLLOUT */
} conn_t;

#define PREFIX_BYTES 256
#define MAX_CACHE 256

static int verbose = 0;
static unsigned long long lru[MAX_CACHE]; /* prefix hashes, most recent first */
static int lru_len = 0, lru_cap = 0;
static unsigned long long prefix_lookups = 0, prefix_hits = 0;
static char *stream_reply;
static size_t stream_reply_len;

static const char CHAT_BODY[] =
    "{\"id\":\"chatcmpl-stub\",\"object\":\"chat.completion\",\"created\":1700000000,"
    "\"model\":\"stub\",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\","
    "\"content\":\"ok\"},\"finish_reason\":\"stop\"}],"
    "\"usage\":{\"prompt_tokens\":8,\"completion_tokens\":1,\"total_tokens\":9}}";
static const char MODELS_BODY[] =
    "{\"object\":\"list\",\"data\":[{\"id\":\"stub\",\"object\":\"model\","
    "\"created\":1700000000,\"owned_by\":\"stub\",\"max_model_len\":4096}]}";
static const char METRICS_BODY[] =
    "# TYPE vllm:num_requests_running gauge\n"
    "vllm:num_requests_running{engine=\"0\",model_name=\"stub\"} 0.0\n"
    "# TYPE vllm:num_requests_waiting gauge\n"
    "vllm:num_requests_waiting{engine=\"0\",model_name=\"stub\"} 0.0\n"
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"stub\"} 0.0\n";
static const char SERVER_INFO_BODY[] =
    "{\"model_path\":\"stub\",\"tokenizer_path\":\"stub\",\"served_model_name\":\"stub\","
    "\"is_generation\":true,\"max_total_num_tokens\":1048576,\"dp_size\":1,"
    "\"load\":0,\"version\":\"0.0.0\"}";
static const char LOAD_BODY[] = "[{\"dp_rank\":0,\"num_reqs\":0,\"num_waiting_reqs\":0,"
                                "\"num_tokens\":0}]";

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void reserve(char **buf, size_t *cap, size_t need) {
    if (need <= *cap) return;
    size_t n = *cap ? *cap : 4096;
    while (n < need) n *= 2;
    char *p = realloc(*buf, n);
    if (!p) die("realloc");
    *buf = p;
    *cap = n;
}

static void put(conn_t *c, const char *data, size_t len) {
    reserve(&c->out, &c->out_cap, c->out_len + len);
    memcpy(c->out + c->out_len, data, len);
    c->out_len += len;
}

static void reply(conn_t *c, int status, const char *ctype, const char *body, size_t len) {
    char head[256];
    const char *reason = status == 200 ? "OK" : status == 404 ? "Not Found" : "Bad Request";
    int n = snprintf(head, sizeof head,
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%s\r\n",
                     status, reason, ctype, len, c->want_close ? "Connection: close\r\n" : "");
    put(c, head, (size_t)n);
    put(c, body, len);
}

/* The whole streamed reply (headers, K events, [DONE], last chunk), built once. */
static void build_stream_reply(int k) {
    static const char EV[] =
        "data: {\"id\":\"chatcmpl-stub\",\"object\":\"chat.completion.chunk\","
        "\"created\":1700000000,\"model\":\"stub\",\"choices\":[{\"index\":0,"
        "\"delta\":{\"content\":\"tok\"},\"finish_reason\":null}]}\n\n";
    static const char DONE[] = "data: [DONE]\n\n";
    static const char HEAD[] =
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
        "Transfer-Encoding: chunked\r\n\r\n";
    size_t ev = sizeof EV - 1, done = sizeof DONE - 1;
    size_t cap = sizeof HEAD + (size_t)(k + 1) * (ev + 16) + 16;
    char *p = malloc(cap);
    if (!p) die("malloc");
    size_t n = 0;
    memcpy(p, HEAD, sizeof HEAD - 1);
    n += sizeof HEAD - 1;
    for (int i = 0; i < k; i++) n += (size_t)sprintf(p + n, "%zx\r\n%s\r\n", ev, EV);
    n += (size_t)sprintf(p + n, "%zx\r\n%s\r\n0\r\n\r\n", done, DONE);
    stream_reply = p;
    stream_reply_len = n;
}

/* Look the body's first message text up in the LRU (and put it first). */
static void prefix_lookup(const char *body, size_t len) {
    static const char KEY[] = "\"content\":\"";
    if (lru_cap == 0) return;
    const char *p = memmem(body, len, KEY, sizeof KEY - 1);
    if (!p) return;
    p += sizeof KEY - 1;
    const char *end = body + len;
    unsigned long long h = 1469598103934665603ULL; /* FNV-1a */
    for (int i = 0; p < end && *p != '"' && i < PREFIX_BYTES; p++, i++)
        h = (h ^ (unsigned char)*p) * 1099511628211ULL;
    prefix_lookups++;
    int at = 0;
    while (at < lru_len && lru[at] != h) at++;
    if (at < lru_len) prefix_hits++;
    else if (lru_len < lru_cap) at = lru_len++;
    else at = lru_len - 1;
    memmove(lru + 1, lru, (size_t)at * sizeof lru[0]);
    lru[0] = h;
}

/* Case-insensitive search for a header name at a line start within [p, end). */
static const char *find_header(const char *p, const char *end, const char *name) {
    size_t nl = strlen(name);
    for (const char *q = p; q && q + nl < end; q = memchr(q, '\n', (size_t)(end - q))) {
        if (*q == '\n') q++;
        if (q + nl < end && strncasecmp(q, name, nl) == 0) return q + nl;
    }
    return NULL;
}

/* Length of the chunked body at [p, end), or -1 if incomplete. */
static long chunked_len(const char *p, const char *end, int *stream) {
    const char *q = p;
    while (q < end) {
        char *e;
        long sz = strtol(q, &e, 16);
        const char *crlf = memmem(q, (size_t)(end - q), "\r\n", 2);
        if (!crlf) return -1;
        q = crlf + 2;
        if (sz == 0) {
            const char *fin = memmem(q - 2, (size_t)(end - q + 2), "\r\n\r\n", 4);
            return fin ? (long)(fin + 4 - p) : -1;
        }
        if (q + sz + 2 > end) return -1;
        if (memmem(q, (size_t)sz, "\"stream\":true", 13) || memmem(q, (size_t)sz, "\"stream\": true", 14))
            *stream = 1;
        q += sz + 2;
    }
    return -1;
}

/* Handle every complete request in c->in; 0 = fine, -1 = close. */
static int handle(conn_t *c) {
    size_t off = 0;
    while (off < c->in_len) {
        char *start = c->in + off, *end = c->in + c->in_len;
        char *hend = memmem(start, (size_t)(end - start), "\r\n\r\n", 4);
        if (!hend) break;
        char *body = hend + 4;
        size_t used;
        int stream = 0;
        const char *te = find_header(start, hend, "transfer-encoding:");
        const char *cl = find_header(start, hend, "content-length:");
        if (te && strncasecmp(te + strspn(te, " "), "chunked", 7) == 0) {
            long n = chunked_len(body, end, &stream);
            if (n < 0) break;
            used = (size_t)(body - start) + (size_t)n;
        } else {
            size_t blen = cl ? strtoul(cl, NULL, 10) : 0;
            if ((size_t)(end - body) < blen) break;
            used = (size_t)(body - start) + blen;
            if (memmem(body, blen, "\"stream\":true", 13) || memmem(body, blen, "\"stream\": true", 14))
                stream = 1;
        }
        const char *conn = find_header(start, hend, "connection:");
        c->want_close = conn && strncasecmp(conn + strspn(conn, " "), "close", 5) == 0;
        char *sp = memchr(start, ' ', (size_t)(hend - start));
        if (!sp) return -1;
        char *path = sp + 1;
        char *pe = memchr(path, ' ', (size_t)(hend - path));
        if (!pe) return -1;
        size_t plen = (size_t)(pe - path);
        char *qm = memchr(path, '?', plen);
        if (qm) plen = (size_t)(qm - path);
#define IS(s) (plen == sizeof(s) - 1 && memcmp(path, s, plen) == 0)
        if (*start == 'P') {
            if (IS("/v1/chat/completions") || IS("/v1/completions") || IS("/generate")) {
                prefix_lookup(body, used - (size_t)(body - start));
                if (stream)
                    put(c, stream_reply, stream_reply_len);
                else
                    reply(c, 200, "application/json", CHAT_BODY, sizeof CHAT_BODY - 1);
            } else {
                if (verbose) fprintf(stderr, "404 POST %.*s\n", (int)plen, path);
                reply(c, 404, "application/json", "{}", 2);
            }
        } else if (IS("/health") || IS("/health_generate") || IS("/readiness") || IS("/liveness")) {
            reply(c, 200, "text/plain", "OK", 2);
        } else if (IS("/v1/models")) {
            reply(c, 200, "application/json", MODELS_BODY, sizeof MODELS_BODY - 1);
        } else if (IS("/metrics")) {
            char m[sizeof METRICS_BODY + 256];
            int n = snprintf(m, sizeof m, "%s# TYPE stub_prefix_lookups_total counter\n"
                             "stub_prefix_lookups_total %llu\n"
                             "# TYPE stub_prefix_hits_total counter\n"
                             "stub_prefix_hits_total %llu\n",
                             METRICS_BODY, prefix_lookups, prefix_hits);
            reply(c, 200, "text/plain; version=0.0.4", m, (size_t)n);
        } else if (IS("/get_server_info") || IS("/get_model_info") || IS("/server_info") ||
                   IS("/model_info")) {
            reply(c, 200, "application/json", SERVER_INFO_BODY, sizeof SERVER_INFO_BODY - 1);
        } else if (IS("/get_load")) {
            reply(c, 200, "application/json", LOAD_BODY, sizeof LOAD_BODY - 1);
        } else {
            if (verbose) fprintf(stderr, "404 GET %.*s\n", (int)plen, path);
            reply(c, 404, "application/json", "{}", 2);
        }
#undef IS
        off += used;
        if (c->want_close) break;
    }
    if (off) {
        memmove(c->in, c->in + off, c->in_len - off);
        c->in_len -= off;
    }
    return c->in_len > MAX_REQ ? -1 : 0;
}

static void close_conn(int ep, conn_t *c) {
    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    free(c->in);
    free(c->out);
    free(c);
}

/* Write what is pending; 1 = all written, 0 = would block, -1 = error. */
static int flush_out(conn_t *c) {
    while (c->out_off < c->out_len) {
        ssize_t n = write(c->fd, c->out + c->out_off, c->out_len - c->out_off);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
            if (errno == EINTR) continue;
            return -1;
        }
        c->out_off += (size_t)n;
    }
    c->out_off = c->out_len = 0;
    return 1;
}

int main(int argc, char **argv) {
    int port = argc > 1 ? atoi(argv[1]) : 0;
    int k = argc > 2 ? atoi(argv[2]) : 64;
    for (int i = 3; i < argc; i++) {
        if (strcmp(argv[i], "-v") == 0) verbose = 1;
        else lru_cap = atoi(argv[i]);
    }
    if (lru_cap < 0 || lru_cap > MAX_CACHE) {
        fprintf(stderr, "CACHE: 0 to %d\n", MAX_CACHE);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    build_stream_reply(k);

    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (lfd < 0) die("socket");
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((unsigned short)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(lfd, (struct sockaddr *)&a, sizeof a) < 0) die("bind");
    if (listen(lfd, 4096) < 0) die("listen");
    socklen_t alen = sizeof a;
    getsockname(lfd, (struct sockaddr *)&a, &alen);
    printf("ready %d\n", ntohs(a.sin_port));
    fflush(stdout);

    int ep = epoll_create1(0);
    if (ep < 0) die("epoll_create1");
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
    struct epoll_event evs[MAX_EVENTS];
    char buf[65536];
    for (;;) {
        int n = epoll_wait(ep, evs, MAX_EVENTS, -1);
        if (n < 0 && errno != EINTR) die("epoll_wait");
        for (int i = 0; i < n; i++) {
            conn_t *c = evs[i].data.ptr;
            if (!c) {
                for (;;) {
                    int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK);
                    if (fd < 0) break;
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    conn_t *nc = calloc(1, sizeof *nc);
                    if (!nc) die("calloc");
                    nc->fd = fd;
                    struct epoll_event cev = {.events = EPOLLIN, .data.ptr = nc};
                    epoll_ctl(ep, EPOLL_CTL_ADD, fd, &cev);
                }
                continue;
            }
            int dead = 0;
            if (evs[i].events & EPOLLIN) {
                for (;;) {
                    ssize_t r = read(c->fd, buf, sizeof buf);
                    if (r > 0) {
                        reserve(&c->in, &c->in_cap, c->in_len + (size_t)r);
                        memcpy(c->in + c->in_len, buf, (size_t)r);
                        c->in_len += (size_t)r;
                        if ((size_t)r < sizeof buf) break;
                    } else if (r == 0) {
                        dead = 1;
                        break;
                    } else {
                        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) dead = 1;
                        break;
                    }
                }
                if (!dead && handle(c) < 0) dead = 1;
            } else if (evs[i].events & (EPOLLHUP | EPOLLERR)) {
                dead = 1;
            }
            if (!dead) {
                int f = flush_out(c);
                if (f < 0) dead = 1;
                else if (f == 1 && c->want_close) dead = 1;
                else if (c->waiting_out == f) { /* only on a change: a syscall saved */
                    struct epoll_event cev = {.events = f ? EPOLLIN : EPOLLIN | EPOLLOUT,
                                              .data.ptr = c};
                    epoll_ctl(ep, EPOLL_CTL_MOD, c->fd, &cev);
                    c->waiting_out = !f;
                }
            }
            if (dead) close_conn(ep, c);
        }
    }
}
