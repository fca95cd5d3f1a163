/* Attention of a few query positions per row over a paged KV pool, read where it lies.
 *
 * Built and loaded by engine/cpu_attention.py (which documents the layout and why). One (batch
 * row, KV head) pair per task, so that a single row's forward uses every thread: the row's key
 * tiles in order (a tile is at most 16 keys and never crosses a block), every query head of the
 * group over a tile while the tile is in cache, the tile AHEAD positions on prefetched. Each
 * query row keeps a running max, a running sum and an accumulator (online softmax), so the pool
 * is read once and nothing the size of K is written. AVX-512 where the build has it and the head
 * size is 32, 64, 128 or 256; plain C otherwise.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define MAX_ROWS 512  /* query heads x query positions of one batch row */
#define TILE 16
#define AHEAD 16

int paged_attention_vectorized(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

#ifdef __AVX512F__
/* e^x for x <= 0 (relative error ~1e-7; far below -87, ~1e-38) */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(1.f / 5040.f);  /* e^f for |f| <= 0.35: Taylor to f^7 */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* v[0..15] -> one vector whose lane t is the sum of v[t]'s lanes */
static inline __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    static const int order[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
    return _mm512_permutexvar_ps(_mm512_loadu_si512(order), d);
}

/* one query row (q, pre-scaled) over a tile of n keys, of which [0, visible) are visible to it;
   CH = head size / 16, a constant where inlined */
static inline __attribute__((always_inline)) void row_tile(
        const float *q, float *acc, float *m, float *l, const float *k, const float *v, int64_t stride, const int CH,
        int n, int visible) {
    __m512 qv[16], dots[TILE], even[16], odd[16];
    for (int c = 0; c < CH; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int t = 0; t < TILE; t++) {
        __m512 s = _mm512_setzero_ps();
        if (t < n)
            for (int c = 0; c < CH; c++) s = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + t * stride + 16 * c), s);
        dots[t] = s;
    }
    const __mmask16 seen = (__mmask16)((1u << visible) - 1u);
    const __m512 scores = sum16(dots);
    const float top = _mm512_mask_reduce_max_ps(seen, scores);
    const float high = top > *m ? top : *m;
    const __m512 p = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(scores, _mm512_set1_ps(high))));
    const float shrink = *m == -INFINITY ? 0.f : expf(*m - high);
    *l = *l * shrink + _mm512_reduce_add_ps(p);
    *m = high;
    float weights[TILE];
    _mm512_storeu_ps(weights, p);
    for (int c = 0; c < CH; c++) {  /* two accumulators per chunk: half the dependency chain */
        even[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), _mm512_set1_ps(shrink));
        odd[c] = _mm512_setzero_ps();
    }
    int t = 0;
    for (; t + 1 < visible; t += 2) {
        const __m512 w0 = _mm512_set1_ps(weights[t]), w1 = _mm512_set1_ps(weights[t + 1]);
        for (int c = 0; c < CH; c++) {
            even[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v + t * stride + 16 * c), even[c]);
            odd[c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(v + (t + 1) * stride + 16 * c), odd[c]);
        }
    }
    if (t < visible) {
        const __m512 w0 = _mm512_set1_ps(weights[t]);
        for (int c = 0; c < CH; c++) even[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v + t * stride + 16 * c), even[c]);
    }
    for (int c = 0; c < CH; c++) _mm512_storeu_ps(acc + 16 * c, _mm512_add_ps(even[c], odd[c]));
}

static int vector_dim(int64_t dim) { return dim == 32 || dim == 64 || dim == 128 || dim == 256; }

static void row_tile_vector(const float *q, float *acc, float *m, float *l, const float *k, const float *v,
                            int64_t stride, int64_t dim, int n, int visible) {
    switch (dim) {  /* unrolled for each head size vector_dim admits */
        case 32: row_tile(q, acc, m, l, k, v, stride, 2, n, visible); break;
        case 64: row_tile(q, acc, m, l, k, v, stride, 4, n, visible); break;
        case 128: row_tile(q, acc, m, l, k, v, stride, 8, n, visible); break;
        default: row_tile(q, acc, m, l, k, v, stride, 16, n, visible); break;
    }
}
#else
static int vector_dim(int64_t dim) { (void)dim; return 0; }
#endif

static void row_tile_scalar(const float *q, float *acc, float *m, float *l, const float *k, const float *v,
                            int64_t stride, int64_t dim, int visible) {
    float s[TILE], top = *m, sum = 0.f;
    for (int t = 0; t < visible; t++) {
        float dot = 0.f;
        for (int64_t d = 0; d < dim; d++) dot += q[d] * k[t * stride + d];
        s[t] = dot;
        if (dot > top) top = dot;
    }
    const float shrink = *m == -INFINITY ? 0.f : expf(*m - top);
    for (int t = 0; t < visible; t++) { s[t] = expf(s[t] - top); sum += s[t]; }
    *l = *l * shrink + sum;
    *m = top;
    for (int64_t d = 0; d < dim; d++) {
        float a = acc[d] * shrink;
        for (int t = 0; t < visible; t++) a += s[t] * v[t * stride + d];
        acc[d] = a;
    }
}

static inline __attribute__((always_inline)) void prefetch_tile(const float *keys, const float *values, const int64_t *table, int64_t first,
                          int64_t last, int64_t block_size, int64_t stride, int64_t head_at, int64_t dim) {
    if (first > last) return;
    const int64_t at = (table[first / block_size] * block_size + first % block_size) * stride + head_at;
    int64_t span = block_size - first % block_size;
    if (span > TILE) span = TILE;
    if (span > last - first + 1) span = last - first + 1;
    for (int64_t t = 0; t < span; t++) {  /* this KV head's dim floats of each key, a 64-byte line at a time, into L2 */
        for (int64_t i = 0; i < dim; i += 16) {
            __builtin_prefetch(keys + at + t * stride + i, 0, 2);
            __builtin_prefetch(values + at + t * stride + i, 0, 2);
        }
    }
}

/* Batch row b, KV head h: its query rows (G query heads x Q positions, G = heads / kv_heads) over
 * the row's key tiles. Returns 0, or -1 when out of memory. */
static int attend_group(const float *query, const float *keys, const float *values, const int64_t *reads,
                        float *out, int64_t b, int64_t h, int64_t heads, int64_t kv_heads, int64_t width,
                        int64_t dim, int64_t block_size, int64_t entries, float scale, int vector) {
    const int64_t rows = heads / kv_heads * width, stride = kv_heads * dim, head_at = h * dim;
    /* per query: its position, then the first position it sees (0, or past a sliding window) */
    const int64_t *positions = reads + b * (2 * width + entries), *lows = positions + width, *table = lows + width;
    float *q = malloc(sizeof(float) * 2 * rows * dim), m[MAX_ROWS], l[MAX_ROWS];
    if (q == NULL) return -1;
    float *acc = q + rows * dim;
    const float *src = query + (b * heads * width + h * rows) * dim;  /* row r: query head h G + r / Q, query r % Q */
    int64_t last = -1, start = INT64_MAX;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t d = 0; d < dim; d++) { q[r * dim + d] = src[r * dim + d] * scale; acc[r * dim + d] = 0.f; }
        m[r] = -INFINITY;
        l[r] = 0.f;
        if (positions[r % width] > last) last = positions[r % width];
        if (lows[r % width] < start) start = lows[r % width];
    }
    if (last >= entries * block_size) last = entries * block_size - 1;  /* never past the table */
    if (start < 0) start = 0;
    for (int64_t first = start; first <= last;) {
        const int64_t j = first / block_size, offset = first % block_size;
        int64_t n = block_size - offset;
        if (n > TILE) n = TILE;
        if (n > last - first + 1) n = last - first + 1;
        prefetch_tile(keys, values, table, first + AHEAD, last, block_size, stride, head_at, dim);
        const int64_t at = (table[j] * block_size + offset) * stride + head_at;
        for (int64_t r = 0; r < rows; r++) {  /* the tile's keys [skip, visible) are this query's */
            int64_t visible = positions[r % width] - first + 1, skip = lows[r % width] - first;
            if (visible > n) visible = n;
            if (skip < 0) skip = 0;
            if (visible <= skip) continue;
            const int64_t from = at + skip * stride;
#ifdef __AVX512F__
            if (vector) {
                row_tile_vector(q + r * dim, acc + r * dim, &m[r], &l[r], keys + from, values + from, stride, dim,
                                (int)(n - skip), (int)(visible - skip));
                continue;
            }
#endif
            row_tile_scalar(q + r * dim, acc + r * dim, &m[r], &l[r], keys + from, values + from, stride, dim,
                            (int)(visible - skip));
        }
        first += n;
    }
    for (int64_t r = 0; r < rows; r++) {
        float *dst = out + ((b * width + r % width) * heads + h * (rows / width) + r / width) * dim;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int64_t d = 0; d < dim; d++) dst[d] = acc[r * dim + d] * inv;
    }
    free(q);
    return 0;
}

/* See cpu_attention.py for the arguments. Returns 0, or -1 for shapes it does not take. */
int paged_attention_f32(const float *query, const float *keys, const float *values, const int64_t *reads,
                        float *out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t width, int64_t dim,
                        int64_t block_size, int64_t entries, float scale, int threads) {
    if (kv_heads < 1 || heads % kv_heads || heads * width > MAX_ROWS || width < 1 || dim < 1) return -1;
    const int vector = paged_attention_vectorized() && vector_dim(dim);
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t task = 0; task < batch * kv_heads; task++) {
        if (attend_group(query, keys, values, reads, out, task / kv_heads, task % kv_heads, heads, kv_heads, width,
                         dim, block_size, entries, scale, vector))
            failed = 1;
    }
    return failed ? -1 : 0;
}
