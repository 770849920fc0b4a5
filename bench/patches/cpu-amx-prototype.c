// Standalone prototype (session 45, not part of the build): decode's tile work over a 4-bit cache on
// a CPU with AMX, one kv head's block staged at a time, stores and tile loads in separate phases.
// D = 128, groups of 64, 4 states, 32-key blocks, 8 kv heads; the scales, biases and softmax are
// stand-ins (cheap), so it bounds what the tiles and the staging cost. bench/RESULTS.md has its
// numbers next to cpu-amx.patch's (the same plan inside decode.rs, slower than the general path).
//   gcc -O2 -mavx512f -mavx512bf16 -mavx512bw -mamx-tile -mamx-bf16 -o amx3 cpu-amx-prototype.c
//   ./amx3 BLOCKS [PREFETCH]     # BLOCKS of 32 keys x 8 heads; 8: in L2, 4096: past the L3
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef struct { uint8_t palette, start_row, r[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) cfg_t;
#define D 128
#define ST 4
#define HKV 8
#define KB 32
static uint32_t codes[KB*D/2] __attribute__((aligned(64)));
static uint32_t pairs[4*2*16*16] __attribute__((aligned(64)));
static uint32_t qv[HKV][4*16*ST] __attribute__((aligned(64)));
static float outs[2*2*256] __attribute__((aligned(64)));
static float outv[8*ST*16] __attribute__((aligned(64)));
static uint16_t probs[2*ST*32] __attribute__((aligned(64)));
static float acc[HKV][8*ST*16] __attribute__((aligned(64)));
static float s[ST*32] __attribute__((aligned(64)));
int PF=1;
static inline __m512i cb(const uint8_t*p){ __m512i z=_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); return _mm512_or_si512(_mm512_ternarylogic_epi32(z,_mm512_slli_epi32(z,12),_mm512_set1_epi32(0x000f000f),0xA8),_mm512_set1_epi32(0x43004300));}
void block(const uint8_t*K,const uint8_t*V,const uint8_t*nK,const uint8_t*nV){ // K,V: [KB][HKV][64 bytes]
  for(int h=0;h<HKV;h++){
    if(PF){ for(int l=0;l<KB*64;l+=64){ _mm_prefetch((const char*)nK+h*KB*64+l,_MM_HINT_T2); _mm_prefetch((const char*)nV+h*KB*64+l,_MM_HINT_T2);} }
    for(int x=0;x<KB;x++){ const uint8_t*r=K+(x*HKV+h)*64; for(int j=0;j<4;j++) _mm512_store_si512(codes+x*64+16*j,cb(r+16*j)); }
    for(int r=0;r<16;r++){ const uint8_t*a=V+((2*r)*HKV+h)*64,*b=V+((2*r+1)*HKV+h)*64; for(int j=0;j<4;j++){
      __m512i za=_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(a+16*j))), zb=_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(b+16*j)));
      __m512i m=_mm512_set1_epi32(0x000f000f), M=_mm512_set1_epi32(0x43004300);
      _mm512_store_si512(pairs+((2*j)*16+r)*16,_mm512_or_si512(_mm512_ternarylogic_epi32(za,_mm512_slli_epi32(zb,16),m,0xA8),M));
      _mm512_store_si512(pairs+((2*j+1)*16+r)*16,_mm512_or_si512(_mm512_ternarylogic_epi32(_mm512_srli_epi32(za,4),_mm512_slli_epi32(zb,12),m,0xA8),M)); } }
    // score tiles
    for(int half=0;half<2;half++) for(int g=0;g<2;g++){ float*o=outs+(half*2+g)*256;
      if(g==0){ _tile_zero(0); for(int j=0;j<2;j++){ _tile_loadd(2,codes+half*16*64+16*j,256); _tile_loadd(3,qv[h]+j*16*ST,ST*4); _tile_dpbf16ps(0,2,3);} _tile_stored(0,o,64);}
      else { _tile_zero(1); for(int j=2;j<4;j++){ _tile_loadd(2,codes+half*16*64+16*j,256); _tile_loadd(3,qv[h]+j*16*ST,ST*4); _tile_dpbf16ps(1,2,3);} _tile_stored(1,o,64);} }
    // combine (no scales: cheap stand-in) + "softmax" stand-in + P'
    __m512i out_at=_mm512_mullo_epi32(_mm512_set_epi32(15,14,13,12,11,10,9,8,7,6,5,4,3,2,1,0),_mm512_set1_epi32(16));
    for(int half=0;half<2;half++) for(int st=0;st<ST;st++){ __m512 a=_mm512_i32gather_ps(out_at,outs+(half*2)*256+st,4), b=_mm512_i32gather_ps(out_at,outs+(half*2+1)*256+st,4);
      _mm512_store_ps(s+st*32+half*16,_mm512_mul_ps(_mm512_add_ps(a,b),_mm512_set1_ps(1e-6f))); }
    for(int g=0;g<2;g++) for(int st=0;st<ST;st++){ __m512 p0=_mm512_load_ps(s+st*32),p1=_mm512_load_ps(s+st*32+16);
      _mm512_store_si512(probs+(g*ST+st)*32,(__m512i)_mm512_cvtne2ps_pbh(p1,p0)); }
    // PV tiles
    for(int j=0;j<4;j++){ _tile_loadd(6,probs+(j/2)*ST*32,64);
      _tile_zero(4); _tile_loadd(7,pairs+((2*j)*16)*16,64); _tile_dpbf16ps(4,6,7); _tile_stored(4,outv+(2*j)*ST*16,64);
      _tile_zero(5); _tile_loadd(7,pairs+((2*j+1)*16)*16,64); _tile_dpbf16ps(5,6,7); _tile_stored(5,outv+(2*j+1)*ST*16,64); }
    for(int c=0;c<8*ST;c++){ __m512 a=_mm512_load_ps(acc[h]+c*16); _mm512_store_ps(acc[h]+c*16,_mm512_fmadd_ps(a,_mm512_set1_ps(0.999f),_mm512_load_ps(outv+c*16))); }
  }
}
int main(int argc,char**argv){ syscall(SYS_arch_prctl,0x1023,18); int nblk=atoi(argv[1]); if(argc>2)PF=atoi(argv[2]);
  cfg_t c; memset(&c,0,sizeof c); c.palette=1;
  int rows[8]={16,16,16,16,ST,ST,ST,16}, colsb[8]={ST*4,ST*4,64,ST*4,64,64,64,64};
  for(int t=0;t<8;t++){c.rows[t]=rows[t];c.colsb[t]=colsb[t];} _tile_loadconfig(&c);
  size_t bb=(size_t)KB*HKV*64; uint8_t*K=aligned_alloc(64,bb*(nblk+1)),*V=aligned_alloc(64,bb*(nblk+1)); for(size_t i=0;i<bb*(nblk+1);i++){K[i]=i*7;V[i]=i*13;}
  for(int h=0;h<HKV;h++) for(int i=0;i<4*16*ST;i++) qv[h][i]=0x3c003c00;
  double best=1e9; for(int r=0;r<5;r++){ double t=now(); for(int b=0;b<nblk;b++) block(K+b*bb,V+b*bb,K+(b+1)*bb,V+(b+1)*bb); t=now()-t; if(t<best)best=t; }
  printf("nblk %d pf %d: %.2f ns per key-head (%.2f GB/s of 4-bit cache)\n",nblk,PF,best*1e9/(nblk*KB*HKV),nblk*bb*2.0/best/1e9);
  printf("%g\n",acc[3][5]); _tile_release(); }
