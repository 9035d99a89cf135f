// llama.cpp's own n-gram drafters (common/ngram-map.cpp, common/ngram-mod.cpp, and the
// ngram-mod draft of common/speculative.cpp copied here) driven step by step, for
// tests/policies/test_ngram.py to compare policies/ngram.py with. stdin:
//   TYPE A B C        simple|k|k4v: size_n size_m min_hits; mod: n_match n_min n_max
//   L t_0 ... t_L-1   the whole token sequence
//   P                 the prompt's length (begin)
//   S, then S lines "cur last": a draft from the context t[:cur] and the sampled token `last`
// stdout: one line per step, the draft's length then its tokens. After a draft, accept
// (cur * 7) % (len + 1) of it.
#include "ngram-map.h"
#include "ngram-mod.h"
#include <iostream>
int main() {
    std::string type; std::cin >> type;
    int a, b, c; std::cin >> a >> b >> c;
    int L; std::cin >> L; llama_tokens all(L); for (auto & t : all) std::cin >> t;
    int P; std::cin >> P;
    int S; std::cin >> S;
    common_ngram_map map(a, b, type == "k", c);
    common_ngram_simple_config sc{(uint16_t)a, (uint16_t)b};
    common_ngram_mod mod(a, 4*1024*1024);
    size_t i_last = 0, n_draft_last = 0; int n_low = 0;
    llama_tokens prompt(all.begin(), all.begin() + P);
    if (type == "k" || type == "k4v") common_ngram_map_begin(map, prompt);
    if (type == "mod") {
        size_t n = mod.get_n();
        if (prompt.size() >= n) { for (size_t i = 0; i < prompt.size() - n; ++i) mod.add(prompt.data() + i); i_last = prompt.size() - n; }
    }
    for (int s = 0; s < S; ++s) {
        int cur, last; std::cin >> cur >> last;
        llama_tokens ctx(all.begin(), all.begin() + cur);
        llama_tokens draft;
        if (type == "simple") draft = common_ngram_simple_draft(sc, ctx, last);
        else if (type == "mod") {
            size_t n = mod.get_n(); n_draft_last = 0;
            if (ctx.size() >= n) {
                if (i_last + 32 < ctx.size()) { for (size_t i = i_last; i < ctx.size() - n; ++i) mod.add(ctx.data() + i); i_last = ctx.size() - n; }
                llama_tokens result(n + c);
                for (size_t i = 0; i < n - 1; ++i) result[i] = ctx.at(ctx.size() - n + 1 + i);
                result[n - 1] = last;
                bool empty = false;
                for (int i = 0; i < c; ++i) {
                    llama_token tok = mod.get(result.data() + i);
                    if (tok == common_ngram_mod::EMPTY) { if (i < b) { result.clear(); empty = true; } else result.resize(n + i); break; }
                    result[n + i] = tok;
                }
                if (!empty) { for (size_t i = 0; n + i < result.size(); ++i) result[i] = result[n + i]; result.resize(result.size() - n); draft = result; n_draft_last = draft.size(); }
            }
        } else common_ngram_map_draft(map, ctx, last, draft);
        std::cout << draft.size(); for (auto t : draft) std::cout << " " << t; std::cout << "\n";
        int nacc = (cur * 7) % (draft.size() + 1);
        if (!draft.empty()) {
            if (type == "k" || type == "k4v") common_ngram_map_accept(map, nacc);
            if (type == "mod" && n_draft_last > 0) {
                double f = (double) nacc / n_draft_last;
                if (f < 0.25) { if (++n_low >= 5) { mod.reset(); n_low = 0; i_last = 0; } } else n_low = 0;
            }
        }
    }
}
